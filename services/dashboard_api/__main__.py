from berth.services.dashboard_api.service import main

main()

from berth.services.scheduler.service import main

main()

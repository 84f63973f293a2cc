from berth.services.worker_agent.service import main

main()

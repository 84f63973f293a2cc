from berth.services.submitter.service import main

main()

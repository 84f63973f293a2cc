from services.submitter.service import main

main()

from acache.cli import main

main()

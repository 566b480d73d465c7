from acache.bench.main import main

main()

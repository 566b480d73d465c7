from bench.main import main

main()

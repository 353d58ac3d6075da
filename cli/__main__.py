from shardbroker.cli.entry import main

main()

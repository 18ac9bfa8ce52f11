from pyspecter.cli import main

main()

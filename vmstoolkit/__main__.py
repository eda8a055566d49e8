from vmstoolkit.cli import main

main()

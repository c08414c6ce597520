from controlplane.cli import main

main()

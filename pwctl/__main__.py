"""`python -m pwctl`: the `pwctl` command."""

from pwctl.cli.main import main

main()

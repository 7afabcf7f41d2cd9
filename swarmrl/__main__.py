"""`python -m swarmrl ...` is the `swarmrl` command (how the launcher starts its local processes)."""

from swarmrl.cli import main

main()

"""`python -m dpmem` (as torchrun's `-m dpmem` runs it) is the `dpmem` command."""

from dpmem.cli import main

main()

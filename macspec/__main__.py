"""`python -m macspec` (the detached daemon starts itself this way)."""

from .cli import main

main(prog_name="macspec")

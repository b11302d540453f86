"""`python -m macspec` (the detached daemon starts itself this way)."""

from .cli import entry

entry()

"""Which host names mean this machine: one rule for the bind address (an API key is required
off loopback) and the Host header check (a loopback server answers only loopback names)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 (bracketed or not), localhost and *.localhost (RFC 6761), any case,
    with or without the root's trailing dot."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False

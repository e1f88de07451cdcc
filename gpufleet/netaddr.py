"""Addresses as they appear after a scheme or before a port: IPv6 in brackets, everything else as is."""

from __future__ import annotations


def bracketed(address: str) -> str:
    """``address`` as the host part of a URL or ``host:port`` (``fd00::1`` -> ``[fd00::1]``)."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def host_port(address: str, port: int) -> str:
    """``HOST:PORT`` for a listen or connect address (``[fd00::1]:6379``, ``10.0.0.1:6379``)."""
    return f"{bracketed(address)}:{port}"

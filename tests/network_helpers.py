"""Loopback helpers for the tests that run a live server (HTTP, WebSocket, the demo page)."""

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port free on loopback now (the tests' servers listen on loopback only)."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]

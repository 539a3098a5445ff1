"""Loopback helpers for the tests that run a live server (HTTP, WebSocket, the demo page)."""

import contextlib
import socket
import threading
import time

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port free on loopback now (the tests' servers listen on loopback only)."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serving_on_loopback(app, start_timeout: float = 30.0, http="auto"):
    """Run an ASGI app with uvicorn in a background thread on a free loopback port; yields the port
    once the server has started, and stops it on exit. `http`: uvicorn's HTTP protocol (a name or
    a class, e.g. the CLI's `header_timeout_protocol`)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, log_level="warning", http=http))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)

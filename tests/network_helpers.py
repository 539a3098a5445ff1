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


def wait_for_health(base: str, process, timeout: float = 120.0) -> None:
    """Poll `base`/health until the server subprocess `process` answers 200; fail when it exits or
    does not answer within `timeout` seconds."""
    import httpx
    import pytest

    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            error = process.stderr.read().decode() if process.stderr is not None else ""
            pytest.fail(f"drama3 serve exited: {error[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"drama3 serve did not answer /health within {timeout:.0f} s")

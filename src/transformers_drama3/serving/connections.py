"""The server's HTTP connections: a deadline for a request's head, JSON for malformed requests.

uvicorn's h11 protocol arms a timer only between requests (keep-alive): a client that connects and
sends nothing, or part of its request line and headers, then stalls, holds its connection (and a
file descriptor) for as long as it likes; a thousand such clients exhaust the server. Here every
request head has `header_timeout` seconds to arrive whole, counted from the connection's opening
or from the first byte of a kept-alive connection's next request; a head still incomplete then is
answered 408 (in OpenAI's error shape) and its connection closed. A malformed request gets its
400 in the same JSON shape instead of uvicorn's plain text.

    uvicorn.run(app, host="127.0.0.1", port=8000, http=header_timeout_protocol(10.0))
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT = 10.0


def _error_bytes(status: int, reason: str, message: str, error_type: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that closes its connection, its body OpenAI's error shape."""
    body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}}).encode("ascii")
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head (`header_timeout` seconds)."""

    header_timeout = DEFAULT_HEADER_TIMEOUT

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._arm_head_timer()  # a client that connects and sends nothing is held to the deadline too

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_head():
            self._arm_head_timer()  # the first bytes of a kept-alive connection's next request
        super().data_received(data)
        if not self._waiting_for_head():
            self._disarm_head_timer()  # the head is whole (or the connection became a WebSocket)

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self.transport.write(_error_bytes(400, "Bad Request", f"not a valid HTTP request ({msg})",
                                          "invalid_request_error", "bad_request"))
        self.transport.close()

    def _waiting_for_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._waiting_for_head():
            return
        self.transport.write(_error_bytes(
            408, "Request Timeout", f"the request's headers did not arrive within {self.header_timeout:g} s",
            "timeout_error", "header_timeout"))
        self.transport.close()


def header_timeout_protocol(seconds: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class (uvicorn's `http=` option) whose request heads have `seconds` to arrive."""
    if not seconds > 0:
        raise ValueError(f"header_timeout={seconds!r}: expected a positive number of seconds")
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": float(seconds)})

"""The server's HTTP connections: a deadline for a request's head, JSON for malformed requests.

uvicorn's h11 protocol arms a timer only between requests (keep-alive): a client that connects and
sends nothing, or part of its request line and headers, then stalls, holds its connection (and a
file descriptor) for as long as it likes; a thousand such clients exhaust the server. Here every
request head has `header_timeout` seconds to arrive whole, counted from the connection's opening
or from the first byte of a kept-alive connection's next request; a head still incomplete then is
answered 408 (in OpenAI's error shape) and its connection closed. A malformed request gets its
400 in the same JSON shape instead of uvicorn's plain text, and a head still incomplete past h11's
16 KiB 431, as a whole head over the limit gets from the app (`request_guard`).

    uvicorn.run(app, host="127.0.0.1", port=8000, http=header_timeout_protocol(10.0))
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

DEFAULT_HEADER_TIMEOUT = 10.0


def _error_bytes(status: int, reason: str, message: str, error_type: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that closes its connection, its body OpenAI's error shape."""
    body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}}).encode("ascii")
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


class _Connection(h11.Connection):
    """h11's connection, keeping the last protocol error (uvicorn answers every one 400 without it)."""

    refusal: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as error:
            self.refusal = error
            raise


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head (`header_timeout` seconds)."""

    header_timeout = DEFAULT_HEADER_TIMEOUT

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.head_limit = config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = _Connection(h11.SERVER, self.head_limit)

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
        if getattr(self.conn.refusal, "error_status_hint", 400) == 431:  # the head passed h11's limit, unfinished
            answer = _error_bytes(431, "Request Header Fields Too Large", f"the request's head is over {self.head_limit} "
                                  "bytes", "invalid_request_error", "headers_too_large")
        else:
            answer = _error_bytes(400, "Bad Request", f"not a valid HTTP request ({msg})", "invalid_request_error",
                                  "bad_request")
        self.transport.write(answer)
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

"""Request ids and the request log.

Every HTTP response carries `x-request-id`, as OpenAI's do (clients log it: LiveKit's agents warn on
every request without one): the id the client sent, if well formed, else a new `req_` + 32 hex
digits. The id is kept in the request's state for the log line of its take.

`log_take` writes one line per speech request to the `transformers_drama3.serving.requests` logger
(`drama3 serve --log-requests` prints it): the id, the voice that spoke, the seed, what was sent
and how long it lasts, and when its first audio left.
"""

from __future__ import annotations

import logging
import re
import secrets

HEADER = b"x-request-id"
WELL_FORMED = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""A client's own request id is echoed only if it is this short and plain (it goes into a header and a log)."""

logger = logging.getLogger("transformers_drama3.serving.requests")


def new_request_id() -> str:
    return "req_" + secrets.token_hex(16)


class RequestIds:
    """ASGI middleware: the request's id into `scope["state"]["request_id"]`, and into the
    `x-request-id` header of its response (every response, errors included)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(HEADER, b"").decode("latin-1")
        request_id = given if WELL_FORMED.fullmatch(given) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(name, value) for name, value in message.get("headers", []) if name.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode("ascii"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def log_take(request_id: str, voice: str | None, seed: int, response_format: str, rate: int, speed: float,
             frames: int, samples: int, first_audio: float | None, seconds: float, finish: str) -> None:
    """One line for a finished speech request: `samples` at `rate` are what the client was sent
    (after `speed`), `first_audio` and `seconds` count from its submission."""
    first = "-" if first_audio is None else f"{first_audio:.3f}s"
    logger.info("speech %s voice=%s seed=%d format=%s rate=%d speed=%g frames=%d audio=%.3fs first_audio=%s "
                "total=%.3fs finish=%s", request_id, voice or "-", seed, response_format, rate, speed, frames,
                samples / rate if rate else 0.0, first, seconds, finish)

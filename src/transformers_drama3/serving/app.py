"""The OpenAI-compatible speech server (FastAPI): `/v1/audio/speech`, voices, models, health, metrics.
The service behind the routes (model, processor, engine, voices, metrics) is `serving.service`.

    service = SpeechService.load(TINY_MODEL_PATH, voices_dir="voices")
    app = create_app(lambda: service, ServerSettings(api_key=None))
    uvicorn.run(app, host="127.0.0.1", port=8000)

The model loads in a background thread at start-up; until it is ready every `/v1` route answers
503. A request is checked, turned into prompt rows by the processor (references encoded once per
voice and cached), queued on the engine and answered whole (offline codec decode of the take) or
streamed (the codec's streaming decoder, window by window; `stream_format` "audio" sends raw
bytes, "sse" sends `speech.audio.delta` / `speech.audio.done` events). A client that disconnects
cancels its request, which frees its slot at the engine's next step.

`/v1/audio/speech/stream` is a WebSocket for text that is still arriving (an LLM's output): the
client sends `start` (the speech fields, no input), `text` pieces and `done`; the server speaks
each streaming chunk as soon as its look-ahead is known (`model.stream_text`) and sends binary
audio and JSON events per chunk. Each text stream runs in its own thread beside the batch engine
(its cache is extended turn by turn, which an engine slot does not do), at most
`ServerSettings.max_text_streams` at once.

This module builds the app: its settings, middleware (the key, Host/Origin checks, CORS, request
ids, the catch-all 500) and error handlers. The routes live by job, each module a `router`:
`status_routes` (health, metrics, probe), `catalog_routes` (models, voices), `speech_routes`
(OpenAI's speech and its WebSocket) and `fish_routes` (Fish Audio's API).
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from . import catalog_routes, fish_routes, speech_routes, status_routes
from .request_log import RequestIds
from .openai_names import VoiceAliases
from .request_guard import LOOPBACK_HOSTS, RequestGuard
from .protocol import ApiError, Limits
from .service import SpeechService, TextStreamSlots, chunk_samples, driven_events, serve_in_background  # noqa: F401
from .speech_answer import (  # noqa: F401  (StreamCut, close_reason: part of this module's names)
    StreamCut,
    _error_response,
    _key_matches,
    _unexpected,
    close_reason,
)
from .voices import VoiceReference

logger = logging.getLogger(__name__)


OPEN_PATHS = ("/health",)
"""Routes that answer without the API key (a load balancer's probe)."""
LISTING_PATHS = ("/v1/models", "/v1/audio/models", "/v1/audio/voices", "/v1/test")
"""The read-only listings (and the probe before them) `ServerSettings.open_listings` leaves open (GET only)."""


@dataclass
class ServerSettings:
    """Server-wide settings: the API key (None: no auth), limits, timeouts. With a key every route
    but `/health` needs it (`/metrics`, `/docs` and `/openapi.json` included); `open_listings` leaves
    GET of the model and voice lists open, for front ends (Open WebUI) that list without credentials."""

    api_key: str | None = None
    open_listings: bool = False
    limits: Limits = field(default_factory=Limits)
    request_timeout: float = 300.0
    max_body_bytes: int = 32 * 2**20
    body_timeout: float = 30.0
    """Seconds a request body may take to arrive whole (then 408): slow senders do not hold connections."""
    max_text_streams: int = 4
    stream_idle_timeout: float = 30.0
    """Seconds a text stream waits for its `start`, and then for each next message (then close code 4408)."""
    voice_aliases: VoiceAliases = field(default_factory=VoiceAliases)
    """Names a request may give for a stored voice (OpenAI's presets; `--voice-alias`)."""
    allowed_hosts: tuple = LOOPBACK_HOSTS
    """Host names requests may name (`--allowed-hosts`; "*": any): others get 403 (`request_guard`)."""
    allowed_origins: tuple = ()
    """Origins of other sites whose pages may use the server (`--allowed-origins`; "*": any; the
    server's own origin always may): others get 403, and these get CORS headers."""


class CatchAll:
    """ASGI middleware: an HTTP request that raises gets a 500 in OpenAI's shape (if its response has
    not started) instead of a plain-text one, and its keep-alive connection keeps serving. A
    streamed response cut midway (`StreamCut`) is left unfinished: the server closes its
    connection without the chunked stream's last chunk."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:
            return  # the client left while sending its body: nobody to answer, nothing went wrong here
        except StreamCut as cut:  # uvicorn closes the connection of a response left unfinished
            logger.warning("%s %s: the stream was cut: %s", scope.get("method"), scope.get("path"), cut)
            return
        except Exception as error:  # the catch-all: every route answers JSON
            response = _error_response(_unexpected(error, f"{scope.get('method')} {scope.get('path')}"), scope.get("path"))
            if not started:
                await response(scope, receive, send)


class KeyGuard:
    """ASGI middleware: the API key on every HTTP route that needs it (401), and a declared body
    over the limit refused before it is read (413). Plain ASGI, not Starlette's BaseHTTPMiddleware,
    which ends a streamed response cleanly even when its route failed midway (`StreamCut`)."""

    def __init__(self, app, settings: ServerSettings):
        self.app, self.settings = app, settings

    def needs_key(self, request: Request) -> bool:
        path, settings = request.url.path, self.settings
        if settings.api_key is None or path in OPEN_PATHS:
            return False
        return not (settings.open_listings and request.method == "GET" and path in LISTING_PATHS)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            request, limit = Request(scope), self.settings.max_body_bytes
            error = None
            if self.needs_key(request) and not _key_matches(request.headers, self.settings.api_key):
                error = ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", None, "invalid_api_key")
            elif request.url.path.startswith("/v1/"):
                length = request.headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > limit:
                    error = ApiError(413, f"the body is {length} bytes; at most {limit}")
            if error is not None:
                return await _error_response(error, request.url.path)(scope, receive, send)
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def create_app(get_service, settings: ServerSettings | None = None):
    """The FastAPI app; `get_service()` returns the `SpeechService`, or None while it loads. The
    routes are the `router`s of `status_routes`, `catalog_routes`, `speech_routes` and
    `fish_routes`; they find `get_service`, `settings` and the text streams' slots on `app.state`."""
    settings = settings or ServerSettings()
    app = FastAPI(title="Drama 3 speech server")
    app.state.get_service, app.state.settings = get_service, settings
    app.state.text_streams = TextStreamSlots(settings.max_text_streams)  # both WebSocket doors share them

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return _error_response(error, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):  # unknown routes, wrong methods
        detail = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        response = _error_response(ApiError(error.status_code, detail.get(error.status_code, str(error.detail)), None,
                                            {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)),
                                   request.url.path)
        response.headers.update(error.headers or {})
        return response

    app.include_router(status_routes.router)  # /health, /metrics, /v1/test
    app.include_router(catalog_routes.router)  # /v1/models, /v1/audio/models, /v1/audio/voices
    app.include_router(speech_routes.router)  # /v1/audio/speech, /v1/audio/speech/stream
    app.include_router(fish_routes.router)  # Fish Audio's API (`/v1/tts`, `/v1/tts/live`), the same service

    app.add_middleware(KeyGuard, settings=settings)
    app.add_middleware(CatchAll)
    if settings.allowed_origins:  # pages of these sites may read the answers (and send JSON, after a preflight)
        app.add_middleware(CORSMiddleware, allow_origins=["*"] if "*" in settings.allowed_origins else list(
            settings.allowed_origins), allow_methods=["GET", "POST", "DELETE"], allow_headers=["Authorization", "Content-Type"],
            expose_headers=list(EXPOSED_HEADERS))
    app.add_middleware(RequestGuard, allowed_hosts=settings.allowed_hosts, allowed_origins=settings.allowed_origins)
    app.add_middleware(RequestIds)  # outermost: every response carries its id, a 500 of CatchAll's included
    return app


EXPOSED_HEADERS = ("X-Sample-Rate", "X-Seed", "X-Finish-Reason", "X-Anomalies", "Retry-After", "x-request-id")
"""Response headers a page of an allowed origin may read."""


__all__ = ["ServerSettings", "SpeechService", "TextStreamSlots", "create_app", "serve_in_background", "VoiceReference",
           "chunk_samples", "driven_events"]

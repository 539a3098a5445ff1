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
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import secrets
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..generation.live_text import ChunkSpoken, ChunkStarted
from ..prompting import CHUNK_BYTES
from .audio_formats import pcm16, streaming_wav_header
from .request_log import RequestIds
from .openai_names import VoiceAliases, model_listing
from .request_guard import LOOPBACK_HOSTS, RequestGuard
from .protocol import (
    RETRY_AFTER_SECONDS,
    ApiError,
    Limits,
    check_speakable,
    speakable,
    TextStreamParams,
    load_json,
    parse_message,
    parse_speech,
    parse_stream_start,
    parse_text_message,
    parse_voice_upload,
)
from .service import SpeechService, TextStreamSlots, chunk_samples, driven_events, serve_in_background  # noqa: F401
from .live_text_run import CANCELLED, TextStreamRun
from .speech_answer import (  # noqa: F401  (StreamCut, close_reason: part of this module's names)
    ErrorResponse,
    StreamCut,
    _error_response,
    _key_matches,
    _read_body,
    _receive_within,
    _unexpected,
    close_reason,
    speak,
)
from .fish_routes import add_fish_routes
from .voices import (
    VoiceBusy,
    VoiceExists,
    VoiceReference,
)

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
    """The FastAPI app; `get_service()` returns the `SpeechService`, or None while it loads."""
    settings = settings or ServerSettings()
    app = FastAPI(title="Drama 3 speech server")

    def service_or_503() -> SpeechService:
        service = get_service()
        if service is None:
            raise ApiError(503, "the model is still loading; retry shortly", None, "loading")
        return service

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

    async def json_body(request: Request):
        _check_json_content_type(request.headers.get("content-type"))
        raw = await _read_body(request, settings.max_body_bytes, settings.body_timeout)
        return await asyncio.to_thread(load_json, raw)  # counted, then parsed, off the event loop

    @app.get("/health")
    async def health():
        service = get_service()
        if service is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok", "model": service.model_name, "running": service.engine.running,
                "queued": service.engine.queue_depth}

    @app.get("/metrics")
    async def metrics():
        service = get_service()
        if service is None:
            return PlainTextResponse("", status_code=503)
        return PlainTextResponse(service.metrics.render(service.engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        service = service_or_503()
        return {"object": "list", "data": model_listing(service.model_name)}

    @app.get("/v1/audio/models")
    async def audio_models():  # Open WebUI asks here first, then falls back to /v1/models
        service = service_or_503()
        return {"models": [{"id": model["id"]} for model in model_listing(service.model_name)]}

    @app.get("/v1/test")
    async def probe():  # Kokoro-FastAPI's probe: bridges that find it (wyoming-openai) list /v1/audio/voices
        service_or_503()
        return {"status": "ok"}

    @app.get("/v1/audio/voices")
    async def list_voices():
        service = service_or_503()
        return {"voices": await asyncio.to_thread(service.voice_listing), "aliases": settings.voice_aliases.listing()}

    @app.post("/v1/audio/voices")
    async def create_voice(request: Request):
        service = service_or_503()
        body = await json_body(request)
        if isinstance(body, dict) and "adapter" in body:  # a fine-tuned voice (serving.adapter_routes)
            from .adapter_routes import register_adapter_voice  # the adapter code loads only when it is used

            return await asyncio.to_thread(register_adapter_voice, service, body, settings.limits)
        voice_id, name, references = parse_voice_upload(body, settings.limits)
        if voice_id in service.voices:
            raise ApiError(409, f"id: a voice {voice_id!r} exists; delete it first", "id", "voice_exists")
        try:
            await asyncio.to_thread(service.voices.add, voice_id, references, name)
        except ValueError as error:
            param = str(error).split(":")[0] if ":" in str(error) else None
            raise ApiError(400, str(error), param) from None
        except VoiceExists as error:
            raise ApiError(409, str(error), "id", "voice_exists") from None
        except VoiceBusy as error:
            raise ApiError(409, str(error), "id", "voice_busy") from None
        except OSError as error:
            logger.error("storing voice %r failed: %s", voice_id, error)
            raise ApiError(500, f"the voice {voice_id!r} could not be stored ({error.strerror or type(error).__name__}); "
                                "nothing was changed", None, "voice_write_failed") from None
        return {"id": voice_id, "name": name}

    @app.delete("/v1/audio/voices/{voice_id}")
    async def delete_voice(voice_id: str):
        service = service_or_503()
        if service.adapter_of(voice_id) is not None:
            from .adapter_routes import delete_adapter_voice

            return await asyncio.to_thread(delete_adapter_voice, service, voice_id)
        try:
            await asyncio.to_thread(service.voices.delete, voice_id)
        except KeyError:
            raise ApiError(404, f"voice: no voice {voice_id!r}", "voice", "voice_not_found") from None
        except VoiceBusy as error:
            raise ApiError(409, str(error), "voice", "voice_busy") from None
        return {"id": voice_id, "deleted": True}

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        service = service_or_503()
        params = parse_speech(await json_body(request), settings.limits, service.has_voice)
        params = dataclasses.replace(params, voice=settings.voice_aliases.resolve(params.voice, service.has_voice))
        return await speak(service, params, request, settings.request_timeout)

    slots = TextStreamSlots(settings.max_text_streams)
    app.state.text_streams = slots

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket):
        await websocket.accept()
        try:
            if settings.api_key is not None and not _key_matches(websocket.headers, settings.api_key):
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", None, "invalid_api_key")
            service = service_or_503()
            start = await _parsed(await _receive_within(websocket, settings.stream_idle_timeout, "start"), "messages[0]")
            params = parse_stream_start(start, settings.limits, service.has_voice, 4 * CHUNK_BYTES)
            params = dataclasses.replace(params, voice=settings.voice_aliases.resolve(params.voice, service.has_voice))
            references = await asyncio.to_thread(service.references_of, params)
            service.check_stream_options(params)
            if not slots.acquire():
                service.metrics.count("rejected")
                raise ApiError(429, f"the server is busy: {slots.limit} text streams are running; retry later", None, "queue_full",
                               {"Retry-After": str(RETRY_AFTER_SECONDS)})
            try:
                await _run_text_stream(websocket, service, params, references, settings)
            finally:
                slots.release()
        except ApiError as error:
            await _close_with_error(websocket, error)
        except WebSocketDisconnect:
            pass
        except Exception as error:  # the catch-all: the client gets an error and a close code
            await _close_with_error(websocket, _unexpected(error, "WebSocket /v1/audio/speech/stream"))

    add_fish_routes(app, settings, get_service, slots)  # Fish Audio's API (`/v1/tts`, `/v1/tts/live`), the same service

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


def _check_json_content_type(value: str | None) -> None:
    """ApiError 415 unless `Content-Type` is application/json: a page of another site may send
    text/plain or a form without asking the server first, never JSON."""
    media = (value or "").split(";")[0].strip().lower()
    if media != "application/json":
        shown = "none" if value is None else repr(value if len(value) <= 64 else value[:61] + "...")
        raise ApiError(415, f"Content-Type {shown}: expected application/json", None, "unsupported_media_type")


async def _parsed(raw, location: str) -> dict:
    """`parse_message` off the event loop (a message of megabytes is counted, then parsed)."""
    return await asyncio.to_thread(parse_message, raw, location)


async def _close_with_error(websocket: WebSocket, error: ApiError) -> None:
    """Send the error in OpenAI's shape, then close with code 4000 + its HTTP status and the
    message as the close frame's reason (cut to the 123 bytes a close frame holds). A 429 says
    when to retry, as HTTP's `Retry-After` does: `retry_after` (seconds) in the event, and the
    reason ends "retry after N s"."""
    event, reason = {"type": "error", **error.body()}, close_reason(error.message)
    retry = (error.headers or {}).get("Retry-After")
    if retry is not None:
        event["retry_after"] = int(retry)
        reason = close_reason(error.message, 123 - len(f"; retry after {retry} s")) + f"; retry after {retry} s"
    try:
        await websocket.send_json(event)
        await websocket.close(code=4000 + error.status, reason=reason)
    except (WebSocketDisconnect, RuntimeError):
        pass  # the client has gone already


def _event_message(item) -> dict:
    if isinstance(item, ChunkStarted):
        return {"type": "chunk.started", "index": item.index, "text": item.text, "look_ahead": item.look_ahead,
                "final_at": item.final_at, "started_at": item.started_at}
    return {"type": "chunk.done", "index": item.index, "frames": item.frames, "finish_reason": item.finish_reason,
            "final_at": item.final_at, "first_audio_at": item.first_audio_at, "delay": item.delay}


async def _run_text_stream(websocket: WebSocket, service: SpeechService, params: TextStreamParams, references, settings):
    """Pieces from the client go to `model.stream_text` in a worker thread (`TextStreamRun`); its
    audio (16-bit PCM) and events come back. A client that goes away, or a session past the time
    limit, stops the worker at its next frame or piece."""
    seed = params.seed if params.seed is not None else secrets.randbelow(2**31)
    run = TextStreamRun(service, params, references, seed, settings.request_timeout, pcm16, _unexpected)

    async def receive():
        index, received, held = 1, 0, []  # held: the pieces before the first letter or digit
        try:
            while True:
                raw = await _receive_within(websocket, settings.stream_idle_timeout, "text or done")
                message = await _parsed(raw, f"messages[{index}]")
                piece = parse_text_message(message, received, settings.limits, index)
                index += 1
                if piece is None:
                    if held is not None:  # the whole text had nothing to say: refused as HTTP refuses it
                        check_speakable("".join(held))
                    run.end()
                    return
                received += len(piece)
                if held is None:
                    run.put(piece)
                    continue
                held.append(piece)
                if speakable(piece):  # the text has something to say: speak it, from its first piece
                    for earlier in held:
                        run.put(earlier)
                    held = None
        except ApiError as error:
            await run.fail(error)
        except WebSocketDisconnect:
            run.cancel()

    rate = service.processor.sampling_rate
    await websocket.send_json({"type": "ready", "sample_rate": rate, "seed": seed, "response_format": params.response_format})
    if params.response_format == "wav":
        await websocket.send_bytes(streaming_wav_header(rate))
    run.start()
    receiver = asyncio.ensure_future(receive())
    started, first, frames, chunks = time.perf_counter(), None, 0, 0
    try:
        while True:
            item = await run.next()
            if isinstance(item, bytes):
                first = time.perf_counter() - started if first is None else first
                await websocket.send_bytes(item)
            elif isinstance(item, (ChunkStarted, ChunkSpoken)):
                message = _event_message(item)
                if message["type"] == "chunk.done":
                    frames, chunks = frames + message["frames"], chunks + 1
                await websocket.send_json(message)
            else:
                outcome = item.outcome
                break
    except (WebSocketDisconnect, RuntimeError, OSError):
        outcome = CANCELLED  # the client went away while audio was being sent
    if outcome is not None:
        run.cancel()
    receiver.cancel()
    await run.join()
    if outcome is CANCELLED:
        service.metrics.count("cancelled")
        return
    if isinstance(outcome, ApiError):
        service.metrics.count("timeout" if outcome.status == 504 else "error")
        raise outcome
    service.metrics.count("eos")
    if first is not None:
        service.metrics.observe_first_audio(first)
    try:
        await websocket.send_json({"type": "done", "frames": frames, "chunks": chunks, "seed": seed})
        await websocket.close(code=1000)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass  # the client left after the last audio


__all__ = ["ServerSettings", "SpeechService", "TextStreamSlots", "create_app", "serve_in_background", "VoiceReference",
           "chunk_samples", "driven_events"]

"""A speech request answered over HTTP, and the pieces every route of the server shares.

`speak` queues a checked speech request (`protocol.SpeechParams`) on the engine and answers it:
whole once the take has ended, or streamed from its first audio (raw bytes of its format, or
OpenAI's SSE events). Both HTTP doors answer through it: OpenAI's `/v1/audio/speech` (`app`) and
Fish Audio's `/v1/tts` (`fish_routes`). Beside it: the app's service, or 503 while it loads
(`service_or_503`), the error body (`ErrorResponse`), a failure no check foresaw (`_unexpected`),
a body read within its limits (`_read_body`, `json_body`), a WebSocket message within a timeout
(`_receive_within`), the key's constant-time check (`_key_matches`), a close frame's reason
(`close_reason`), a WebSocket's errors answered (`socket_errors`), and a text stream's slot
(`text_stream_slot`), first speakable piece (`put_when_speakable`) and ending
(`text_stream_ended`, counted in the metrics).

The routes find what `app.create_app` was given on the app: `app.state.get_service` (the service,
None while it loads), `app.state.settings` (`ServerSettings`) and `app.state.text_streams` (the
text streams' `TextStreamSlots`, shared by both WebSocket doors).
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import queue
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Request, WebSocket, WebSocketDisconnect
from fastapi.requests import HTTPConnection
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..codec.take_audio import WaveformStreamer
from .audio_formats import MEDIA_TYPES, encode, encoded_rate, stream_encoder
from .engine import DoneEvent, EngineStopped, ErrorEvent, FramesEvent, QueueFull
from .output_audio import OutputAudio, output_rate
from .protocol import RETRY_AFTER_SECONDS, ApiError, SpeechParams, damaged_adapter, load_json, speakable
from .request_log import log_take
from .routing import AdapterError, AdapterSlotsBusy
from .service import SpeechService, chunk_samples
from .live_text_run import CANCELLED

POLL_SECONDS = 0.25
"""How often a waiting handler looks for its client having gone."""

logger = logging.getLogger(__name__)


class ErrorResponse(JSONResponse):
    """An error body, written as ASCII JSON: a message that quotes the client's text cannot fail to
    encode (a lone surrogate is written as its escape)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def service_or_503(connection: HTTPConnection) -> SpeechService:
    """The app's service (a request's or a WebSocket's); ApiError 503 while the model loads."""
    service = connection.app.state.get_service()
    if service is None:
        raise ApiError(503, "the model is still loading; retry shortly", None, "loading")
    return service


def _error_response(error: ApiError, path: str | None = None):
    """The error as the route at `path` answers it: OpenAI's shape, Fish Audio's on its routes."""
    return ErrorResponse(error.body(path), status_code=error.status, headers=error.headers)


def _unexpected(error: Exception, where: str) -> ApiError:
    """A failure no check foresaw: logged as one line, answered as a 500 in OpenAI's shape naming
    only the kind of failure (its text may hold server paths and Python internals: the log has it)."""
    summary = f"{type(error).__name__}: {error}".replace("\n", " ")
    logger.error("%s failed: %s", where, summary)
    return ApiError(500, f"the server failed ({type(error).__name__}); the server's log has the details", None,
                    "internal_error")


async def _next_event(handle, request):
    """The handle's next event; cancels the request (and returns None) when the client has gone."""
    while True:
        try:
            return await asyncio.to_thread(handle.queue.get, True, POLL_SECONDS)
        except queue.Empty:
            if await request.is_disconnected():
                handle.cancel()
                return None


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, counted as it arrives: 413 as soon as it passes `limit` bytes (a chunked body
    declares no length), 408 when it has not arrived whole within `timeout` seconds."""
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the body is over {limit} bytes", None, "body_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the body did not arrive within {timeout:g} s ({size} bytes came)", None, "timeout") from None
    return b"".join(chunks)


async def json_body(request: Request):
    """The request's JSON body: 415 unless it says it is JSON, then read within the app's limits
    (`_read_body`) and parsed off the event loop (`protocol.load_json`)."""
    _check_json_content_type(request.headers.get("content-type"))
    settings = request.app.state.settings
    raw = await _read_body(request, settings.max_body_bytes, settings.body_timeout)
    return await asyncio.to_thread(load_json, raw)  # counted, then parsed, off the event loop


def _check_json_content_type(value: str | None) -> None:
    """ApiError 415 unless `Content-Type` is application/json: a page of another site may send
    text/plain or a form without asking the server first, never JSON."""
    media = (value or "").split(";")[0].strip().lower()
    if media != "application/json":
        shown = "none" if value is None else repr(value if len(value) <= 64 else value[:61] + "...")
        raise ApiError(415, f"Content-Type {shown}: expected application/json", None, "unsupported_media_type")


async def _receive_within(websocket: WebSocket, timeout: float, what: str):
    """The next message (`_receive`); ApiError 408 when none arrives within `timeout` seconds."""
    try:
        return await asyncio.wait_for(_receive(websocket), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"no {what} message within {timeout:g} s", None, "timeout") from None


async def _cancel_when_gone(handle, request) -> None:
    """Cancel the request once its client has gone. The body has been read, so the next ASGI message
    is the disconnect: waiting for it notices a client that left at once, whether or not frames are
    arriving (a running request yields one every step)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()


def _key_matches(headers, api_key: str) -> bool:
    """Whether `Authorization: Bearer KEY` carries the key, compared in constant time."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


def _failure(event: ErrorEvent) -> ApiError:
    """The answer to a request the engine ended: 504 past its time limit; else a 500 naming the kind
    of failure, its text logged (it may hold server paths and Python internals)."""
    if event.kind == "timeout":
        return ApiError(504, "the request ran past its time limit", None, "timeout")
    logger.error("generation failed: %s", event.message.replace("\n", " "))
    return ApiError(500, f"generation failed ({event.message.split(':', 1)[0]}); the server's log has the details",
                    None, event.kind)


async def speak(service: SpeechService, params: SpeechParams, request: Request, timeout: float):
    """A checked speech request (`/v1/audio/speech`'s, or Fish Audio's `/v1/tts` mapped onto it) queued
    on the engine and answered: whole (`stream_format` None), or streamed from its first audio (a
    failure before it keeps its status). Raises ApiError (429 busy, 503 stopped, 404 a deleted
    adapter voice, 409 a damaged one, or the take's own failure before any audio). `timeout`:
    seconds the take may run (`--timeout`)."""
    job = await asyncio.to_thread(service.job, params, timeout)
    try:  # in a thread: an adapter voice out of its slot is read from disk here
        handle = await asyncio.to_thread(service.engine.submit, job)
    except QueueFull as error:
        service.metrics.count("rejected")
        raise ApiError(429, f"the server is busy: {error}; retry later", None, "queue_full",
                       {"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except EngineStopped as error:
        raise ApiError(503, str(error), None, "stopped") from None
    except AdapterSlotsBusy as error:
        service.metrics.count("rejected")
        raise ApiError(429, str(error), "voice", "adapter_slots_busy", {"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except KeyError:  # its adapter was deleted since the request was checked
        raise ApiError(404, f"voice: no voice {params.voice!r}", "voice", "voice_not_found") from None
    except AdapterError as error:  # its adapter's folder changed on disk since it was registered
        raise damaged_adapter(params.voice, error) from None
    rate = output_rate(params.response_format, service.processor.sampling_rate, params.sample_rate)
    headers = {"X-Sample-Rate": str(encoded_rate(params.response_format, rate)), "X-Seed": str(handle.seed)}
    take = _Take(handle, params, rate, request.state.request_id, service.voice_of(params))
    if params.stream_format is None:
        return await _whole(service, take, request, headers)
    body = _stream(service, take, request)
    watcher = asyncio.ensure_future(_cancel_when_gone(handle, request))  # once it streams, Starlette watches
    try:  # the response starts with the first audio: a failure before it keeps its status
        first = await body.__anext__()
    except StopAsyncIteration:  # the client left before any audio
        return Response(status_code=499)
    finally:
        watcher.cancel()
    media = "text/event-stream" if params.stream_format == "sse" else MEDIA_TYPES[params.response_format]
    return StreamingResponse(_after(first, body), media_type=media, headers=headers)


async def _whole(service, take, request, headers):
    """A take sent whole, once it has ended (offline codec decode)."""
    handle, params = take.handle, take.params
    watcher = asyncio.ensure_future(_cancel_when_gone(handle, request))
    try:
        while True:
            event = await _next_event(handle, request)
            if event is None or (isinstance(event, ErrorEvent) and event.kind == "cancelled"):
                return Response(status_code=499)  # nobody is listening
            if isinstance(event, ErrorEvent):
                raise _failure(event)
            if isinstance(event, DoneEvent):
                break
    finally:
        watcher.cancel()
    waveform = await asyncio.to_thread(service.waveform, event.codes)
    _observe(service, handle, time.perf_counter() - handle.submitted, waveform.shape[0])
    output = OutputAudio(service.processor.sampling_rate, take.rate, params.speed, params.volume_db)
    samples = await asyncio.to_thread(output.whole, waveform)
    data = await asyncio.to_thread(encode, samples, take.rate, params.response_format, params.bit_rate)
    take.log(event, samples.size, time.perf_counter() - handle.submitted)
    headers = {**headers, "X-Finish-Reason": event.finish_reason, "X-Anomalies": ",".join(event.anomalies)}
    return Response(data, media_type=MEDIA_TYPES[params.response_format], headers=headers)


async def _receive(websocket: WebSocket):
    """The next message's text (or bytes); raises WebSocketDisconnect when the client has gone."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    return message.get("text") if message.get("text") is not None else message.get("bytes")


def close_reason(message: str, limit: int = 123) -> str:
    """`message` cut to at most `limit` UTF-8 bytes (a WebSocket close frame's reason), whole characters kept."""
    data = message.encode("utf-8", "replace")  # a lone surrogate the message quotes becomes "?"
    return data.decode("utf-8") if len(data) <= limit else data[: limit - 3].decode("utf-8", "ignore") + "..."


@asynccontextmanager
async def socket_errors(websocket: WebSocket, send_error, where: str):
    """Within the block, an ApiError is answered by `send_error(websocket, error)` (each door has its
    shape), a failure no check foresaw as a 500 (`_unexpected`, logged naming `where`), and a
    client that has gone is let go."""
    try:
        yield
    except ApiError as error:
        await send_error(websocket, error)
    except WebSocketDisconnect:
        pass
    except Exception as error:  # the catch-all: the client gets an error and a close code
        await send_error(websocket, _unexpected(error, where))


def put_when_speakable(run, held: list | None, piece: str) -> list | None:
    """`piece` put into the text stream `run`, or held while no piece so far has a letter or digit
    (`protocol.speakable`); `held` is the pieces held so far, None once the text speaks. Returns the
    new `held`: once a piece speaks, the held pieces go first, then it, and None."""
    if held is None:
        run.put(piece)
        return None
    held.append(piece)
    if not speakable(piece):
        return held
    for earlier in held:
        run.put(earlier)
    return None


def text_stream_slot(connection: HTTPConnection, service: SpeechService):
    """A slot for one more text stream (`app.state.text_streams`, shared by both WebSocket doors),
    or ApiError 429 (counted as rejected) when all are taken; the caller releases it."""
    slots = connection.app.state.text_streams
    if not slots.acquire():
        service.metrics.count("rejected")
        raise ApiError(429, f"the server is busy: {slots.limit} text streams are running; retry later", None,
                       "queue_full", {"Retry-After": str(RETRY_AFTER_SECONDS)})
    return slots


def text_stream_ended(service: SpeechService, outcome, first_audio: float | None) -> bool:
    """Count how a text stream ended (`TextStreamRun`'s `Finished.outcome`) in the metrics: True when
    its text was spoken to the end (its seconds to the first audio observed), False when its client
    went away; an ApiError that ended it (504 past its time limit, or another failure) is raised."""
    if outcome is CANCELLED:
        service.metrics.count("cancelled")
        return False
    if isinstance(outcome, ApiError):
        service.metrics.count("timeout" if outcome.status == 504 else "error")
        raise outcome
    service.metrics.count("eos")
    if first_audio is not None:
        service.metrics.observe_first_audio(first_audio)
    return True


def _observe(service, handle, first_audio: float, samples: int) -> None:
    service.metrics.observe_first_audio(first_audio)
    seconds = samples / service.processor.sampling_rate
    if seconds > 0:
        service.metrics.observe_real_time_factor((time.perf_counter() - handle.submitted) / seconds)


def _usage(job, event: DoneEvent) -> dict:
    """OpenAI's usage of a take: input tokens are its prompt rows, output tokens its frames (one
    backbone step each)."""
    prompt, frames = int(job.input_ids.shape[-1]), int(event.codes.shape[0])
    return {"input_tokens": prompt, "output_tokens": frames, "total_tokens": prompt + frames}


class StreamCut(Exception):
    """A streamed take that failed after its response began (past `--timeout`): the raw audio
    stream is cut without its last chunk, so the client sees it failed (`CatchAll`)."""


@dataclass
class _Take:
    """A submitted speech request: its handle, checked fields, output rate, request id and the voice
    that speaks it (for the request log)."""

    handle: object
    params: SpeechParams
    rate: int
    request_id: str
    voice: str | None

    def log(self, event: DoneEvent, samples: int, seconds: float, first_audio: float | None = None) -> None:
        log_take(self.request_id, self.voice, self.handle.seed, self.params.response_format, self.rate,
                 self.params.speed, int(event.codes.shape[0]), samples,
                 seconds if first_audio is None else first_audio, seconds, event.finish_reason)


async def _after(first: bytes, rest):
    """`first`, then the rest of an async generator's items."""
    yield first
    async for item in rest:
        yield item


async def _stream(service, take: _Take, request):
    """The bytes (or SSE events) of a streamed take, from its first audio on (a wav header goes out
    with it); cancels the request if the client goes away. A failure before the first bytes raises
    its ApiError (the response has not started, so it keeps its status); one after them ends the
    stream with an error: SSE an `{"type": "error", "error": ...}` event (no `speech.audio.done`),
    raw audio a chunked stream cut before its last chunk (`StreamCut`)."""
    handle, params = take.handle, take.params
    streamer = WaveformStreamer(service.processor.codec, handle.submitted, first_window=params.first_window)
    output = OutputAudio(service.processor.sampling_rate, take.rate, params.speed, params.volume_db)
    sse = params.stream_format == "sse"
    first, made, samples, yielded = None, 0, 0, False  # made: samples at the model's rate; samples: as sent

    def wrap(data: bytes) -> bytes:
        if not sse:
            return data
        event = {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}
        return f"data: {json.dumps(event)}\n\n".encode()

    encoder = stream_encoder(params.response_format, take.rate, params.bit_rate)
    pending = encoder.head()  # held until the first audio: an error before it still gets its status
    try:
        while True:
            event = await _next_event(handle, request)
            if event is None or (isinstance(event, ErrorEvent) and event.kind == "cancelled"):
                return  # nobody is listening
            if isinstance(event, ErrorEvent):  # past --timeout, or failed: the client must not take it as whole
                error = _failure(event)
                if not yielded:
                    raise error  # the response has not started: it answers with the error's status
                if not sse:
                    raise StreamCut(error.message)
                yield f"data: {json.dumps({'type': 'error', **error.body()})}\n\n".encode()
                return
            if isinstance(event, FramesEvent):
                chunks = await asyncio.to_thread(service.codec_work, streamer.push, list(event.frames))
            else:
                chunks = await asyncio.to_thread(service.codec_work, streamer.finish)
            made_now = chunk_samples(chunks)
            made += sum(piece.size for piece in made_now)
            pieces = [output.push(piece) for piece in made_now]
            if isinstance(event, DoneEvent):
                pieces.append(output.finish())
            for piece in pieces:
                if not piece.size:
                    continue
                if first is None:
                    first = time.perf_counter() - handle.submitted
                samples += piece.size
                data = pending + await asyncio.to_thread(encoder.push, piece)
                if data:
                    pending, yielded = b"", True
                    yield wrap(data)
            if isinstance(event, DoneEvent):
                data = pending + await asyncio.to_thread(encoder.finish)
                if data or not yielded:  # a take without audio still answers (an empty body)
                    yield wrap(data) if data else b""
                if first is not None:
                    _observe(service, handle, first, made)
                take.log(event, samples, time.perf_counter() - handle.submitted, first)
                if sse:
                    done = {"type": "speech.audio.done", "usage": _usage(handle.job, event)}
                    yield f"data: {json.dumps(done)}\n\n".encode()
                return
    finally:
        encoder.close()
        handle.cancel()  # a no-op once the request has ended; frees the slot when the client left


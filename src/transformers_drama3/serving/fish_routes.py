"""Fish Audio's API in `drama3 serve`: `POST /v1/tts` and the WebSocket `/v1/tts/live`, so that
fish-audio-sdk (both clients) and LiveKit's Fish Audio plugin speak through the server by their
base URL alone. The requests are mapped onto the server's own (`fish_protocol`); the key, limits,
Host/Origin checks and errors are the server's, each error answered as `{"status", "message"}`.

- `POST /v1/tts`: a MessagePack (or JSON) body; the take is queued on the engine as
  `/v1/audio/speech` queues it and streamed in the asked format from its first audio (chunked).
- `/v1/tts/live`: binary MessagePack events. The client sends `{"event": "start", "request":
  {...}}`, `{"event": "text", "text"}` pieces, `{"event": "flush"}` (speak what came so far, to its
  end, without waiting for more) and `{"event": "stop"}`; the server answers `{"event": "audio",
  "audio": bytes}` as it is made (one stream of the asked format per utterance), then `{"event":
  "finish", "reason": "stop"}`, and the socket stays open for the next `start` (LiveKit reuses it).
  The text runs through the text stream (`TextStreamRun`, `model.stream_text`); each flushed
  segment is a text stream of its own. An error ends the utterance with `{"event": "finish",
  "reason": "error", "status", "message"}` and closes the socket (code 4000 + status); a missing
  or wrong key, or a model still loading, refuses the handshake itself (401 / 503).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time

import msgpack
from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect

from ..generation.live_text import ChunkSpoken
from .speech_answer import (ErrorResponse, _key_matches, _read_body, _receive_within, _unexpected, close_reason,
                            put_when_speakable, service_or_503, socket_errors, speak, text_stream_ended,
                            text_stream_slot)
from .audio_formats import stream_encoder
from .fish_protocol import FishRequest, fish_live_start, fish_speech, load_msgpack, media_loader
from .output_audio import OutputAudio
from .protocol import ApiError, TextStreamParams
from .request_log import log_take, new_request_id
from .live_text_run import CANCELLED, Finished, TextStreamRun

logger = logging.getLogger(__name__)

LIVE_PATH = "/v1/tts/live"
BETWEEN_UTTERANCES_SECONDS = 300.0
"""How long an open socket waits for its next `start` (LiveKit keeps a pooled socket 300 s); within
an utterance each next event must come within `--stream-idle-timeout`."""


router = APIRouter()
"""`/v1/tts` and `/v1/tts/live`, which `app.create_app` includes; the service, settings and text
stream slots (shared with `/v1/audio/speech/stream`) come from the app (`speech_answer`)."""


@router.post("/v1/tts")
async def fish_tts(request: Request):
    service, settings = service_or_503(request), request.app.state.settings
    loader = media_loader(request.headers.get("content-type"))  # 415 before the body is read
    raw = await _read_body(request, settings.max_body_bytes, settings.body_timeout)
    body = await asyncio.to_thread(loader, raw)  # counted, then unpacked, off the event loop
    fish = await asyncio.to_thread(fish_speech, body, request.headers.get("model"), service.model_name,
                                   settings.limits, service.has_voice)  # reference clips are read here
    return await speak(service, _with_voice(fish.speech, service, settings), request, settings.request_timeout)


@router.websocket(LIVE_PATH)
async def fish_live(websocket: WebSocket):
    settings = websocket.app.state.settings
    if settings.api_key is not None and not _key_matches(websocket.headers, settings.api_key):
        return await _deny(websocket, ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)"))
    service = websocket.app.state.get_service()
    if service is None:
        return await _deny(websocket, ApiError(503, "the model is still loading; retry shortly"))
    await websocket.accept()
    async with socket_errors(websocket, _finish_with_error, f"WebSocket {LIVE_PATH}"):
        await _live_session(websocket, service, settings)


def _with_voice(speech, service, settings):
    """The request with its `reference_id` resolved (an operator's alias) and known: 404 naming it."""
    voice = settings.voice_aliases.resolve(speech.voice, service.has_voice, "reference_id")
    if voice is not None and not service.has_voice(voice):
        raise ApiError(404, f"reference_id: no voice {voice!r}; registered: {service.voices.ids()}", "reference_id",
                       "voice_not_found")
    return dataclasses.replace(speech, voice=voice)


async def _deny(websocket: WebSocket, error: ApiError) -> None:
    """Refuse the handshake with the error's HTTP status and Fish Audio's error body."""
    response = ErrorResponse(error.body(LIVE_PATH), status_code=error.status, headers=error.headers)
    try:
        await websocket.send_denial_response(response)
    except RuntimeError:  # a server without the denial extension: the handshake is refused all the same
        await websocket.close(code=1008)


async def _send(websocket: WebSocket, event: dict) -> None:
    await websocket.send_bytes(msgpack.packb(event, use_bin_type=True))


async def _finish_with_error(websocket: WebSocket, error: ApiError) -> None:
    """`{"event": "finish", "reason": "error", "status", "message"}`, then close with 4000 + status."""
    try:
        await _send(websocket, {"event": "finish", "reason": "error", **error.body(LIVE_PATH)})
        await websocket.close(code=4000 + error.status, reason=close_reason(error.message))
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass  # the client has gone already


async def _next_event(websocket: WebSocket, timeout: float, what: str, index: int) -> dict:
    """The next event: a binary frame holding a MessagePack map with a string `event`."""
    raw = await _receive_within(websocket, timeout, what)
    location = f"events[{index}]"
    if not isinstance(raw, bytes):
        raise ApiError(400, f"{location}: expected a binary frame of MessagePack; got text", location)
    event = await asyncio.to_thread(load_msgpack, raw, location)
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        raise ApiError(400, f"{location}: expected a map with an \"event\" (start, text, flush, stop)",
                       f"{location}.event")
    return event


async def _live_session(websocket: WebSocket, service, settings) -> None:
    """Utterances, one after another, until the client closes the socket."""
    model, index = websocket.headers.get("model"), 0
    while True:
        event = await _next_event(websocket, BETWEEN_UTTERANCES_SECONDS, "start", index)
        index += 1
        if event["event"] != "start":
            raise ApiError(400, f"event: {event['event']!r} before any start; an utterance begins with "
                                "{\"event\": \"start\", \"request\": {...}}", "event")
        started = time.perf_counter()
        fish = await asyncio.to_thread(fish_live_start, event, model, service.model_name, settings.limits,
                                       service.has_voice)
        index = await _utterance(websocket, service, settings, fish, index, started)


async def _utterance(websocket, service, settings, fish: FishRequest, index: int, started: float) -> int:
    """One utterance: its text events in, its audio out, then `finish`; the index of the next event."""
    speech = _with_voice(fish.speech, service, settings)
    params = TextStreamParams(model=speech.model, voice=speech.voice, response_format="pcm",
                              references=speech.references, options=speech.options, chunk_bytes=fish.chunk_bytes)
    references = await asyncio.to_thread(service.references_of, params)
    service.check_stream_options(params)
    slots = text_stream_slot(websocket, service)
    output = OutputAudio(service.processor.sampling_rate, speech.sample_rate, speech.speed, speech.volume_db)
    encoder = stream_encoder(speech.response_format, speech.sample_rate, speech.bit_rate)
    sent = {"samples": 0}

    def audio(samples):  # in the worker thread: the stages and the encoder stay off the event loop
        out = output.push(samples)
        sent["samples"] += out.size
        return encoder.push(out) if out.size else None

    seed = speech.seed if speech.seed is not None else secrets.randbelow(2**31)
    run = TextStreamRun(service, params, references, seed, settings.request_timeout, audio, _unexpected,
                        first_window=speech.first_window)
    receiver, outcome = None, CANCELLED
    try:
        run.start()
        next_index = asyncio.get_running_loop().create_future()
        receiver = asyncio.ensure_future(_receive_text(websocket, settings, run, speech.input, index, next_index))
        outcome, first, frames, pending = await _send_audio(websocket, run, encoder.head(), started)
        if outcome is None:  # spoken to the end: what the stages and the encoder still hold
            tail = await asyncio.to_thread(output.finish)
            sent["samples"] += tail.size
            data = pending + await asyncio.to_thread(lambda: encoder.push(tail) + encoder.finish())
            if data:
                first = time.perf_counter() - started if first is None else first
                await _send(websocket, {"event": "audio", "audio": data})
    except (WebSocketDisconnect, RuntimeError, OSError):
        outcome = CANCELLED  # the client went away while audio was being sent
    finally:
        if outcome is not None:  # failed or cancelled: the worker stops at its next frame or piece
            run.cancel()
        if receiver is not None:
            receiver.cancel()
        await run.join()
        encoder.close()
        slots.release()
    if not text_stream_ended(service, outcome, first):
        raise WebSocketDisconnect(1001)
    log_take(new_request_id(), service.voice_of(speech), seed, speech.response_format, speech.sample_rate, speech.speed,
             frames, sent["samples"], first, time.perf_counter() - started, "stop")
    await _send(websocket, {"event": "finish", "reason": "stop"})
    return next_index.result()


async def _send_audio(websocket, run: TextStreamRun, head: bytes, started: float):
    """The run's audio as `audio` events until it finishes: (outcome, seconds to the first audio,
    frames spoken, the bytes not sent yet: a wav header waits for the first audio)."""
    first, frames, pending = None, 0, head
    while True:
        item = await run.next()
        if isinstance(item, Finished):
            return item.outcome, first, frames, pending
        if isinstance(item, ChunkSpoken):
            frames += item.frames
        elif isinstance(item, bytes) and item:
            first = time.perf_counter() - started if first is None else first
            await _send(websocket, {"event": "audio", "audio": pending + item})
            pending = b""


async def _receive_text(websocket, settings, run: TextStreamRun, text: str, index: int, next_index) -> None:
    """The utterance's events into the run: text pieces (the start's own text first), `flush`
    ending a segment, `stop` ending the text. A segment's pieces are held until one has a letter or
    digit; a segment with none is dropped (a flush of only punctuation says nothing). The whole
    text of the utterance is held to the input limit (413)."""
    received, held = 0, []  # held: the segment's pieces before one has something to say; None once it has
    if text:
        received += len(text)
    try:
        pieces = [text] if text else []
        while True:
            for value in pieces:
                held = put_when_speakable(run, held, value)
            event = await _next_event(websocket, settings.stream_idle_timeout, "text, flush or stop", index)
            index += 1
            kind, pieces = event["event"], []
            if kind == "text":
                value = event.get("text")
                if not isinstance(value, str):
                    raise ApiError(400, f"text: event {index - 1} must carry a string; got {type(value).__name__}",
                                   "text")
                received += len(value)
                if received > settings.limits.max_input_chars:
                    raise ApiError(413, f"text: {received} characters; at most {settings.limits.max_input_chars}",
                                   "text")
                pieces = [value] if value else []
            elif kind in ("flush", "stop"):
                speaking, held = held is None, []  # pieces with nothing to say at the end of a segment are dropped
                if kind == "stop":
                    run.end()
                    next_index.set_result(index)
                    return
                if speaking:
                    run.flush()
            elif kind == "start":
                raise ApiError(400, "event: start while an utterance is running; send stop first", "event")
            else:
                raise ApiError(400, f"event: {kind!r}; expected text, flush or stop", "event")
    except ApiError as error:
        await run.fail(error)
    except WebSocketDisconnect:
        run.cancel()

"""OpenAI's speech: `POST /v1/audio/speech` (answered whole or streamed, `speech_answer.speak`) and
the WebSocket `/v1/audio/speech/stream` for text that is still arriving (an LLM's output).

The WebSocket: the client sends `start` (the speech fields, no input), `text` pieces and `done`;
the server speaks each streaming chunk as soon as its look-ahead is known (`model.stream_text`, in
a `TextStreamRun` worker thread beside the batch engine) and sends binary audio and JSON events
(`ready`, `chunk.started`, `chunk.done`, `done`) per chunk. An error is sent as an `error` event,
then the socket closes with code 4000 + its HTTP status. `app.create_app` includes `router`; the
service, settings and text stream slots come from the app (`speech_answer`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect

from ..generation.live_text import ChunkSpoken, ChunkStarted
from ..prompting import CHUNK_BYTES
from .audio_formats import pcm16, streaming_wav_header
from .protocol import (
    ApiError,
    TextStreamParams,
    check_speakable,
    parse_message,
    parse_speech,
    parse_stream_start,
    parse_text_message,
)
from .service import SpeechService
from .speech_answer import (_key_matches, _receive_within, _unexpected, close_reason, json_body, put_when_speakable,
                            service_or_503, socket_errors, speak, text_stream_ended, text_stream_slot)
from .live_text_run import CANCELLED, TextStreamRun

router = APIRouter()

STREAM_PATH = "/v1/audio/speech/stream"


@router.post("/v1/audio/speech")
async def speech(request: Request):
    service, settings = service_or_503(request), request.app.state.settings
    params = parse_speech(await json_body(request), settings.limits, service.has_voice)
    params = dataclasses.replace(params, voice=settings.voice_aliases.resolve(params.voice, service.has_voice))
    return await speak(service, params, request, settings.request_timeout)


@router.websocket(STREAM_PATH)
async def speech_stream(websocket: WebSocket):
    settings = websocket.app.state.settings
    await websocket.accept()
    async with socket_errors(websocket, _close_with_error, f"WebSocket {STREAM_PATH}"):
        if settings.api_key is not None and not _key_matches(websocket.headers, settings.api_key):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", None, "invalid_api_key")
        service = service_or_503(websocket)
        start = await _parsed(await _receive_within(websocket, settings.stream_idle_timeout, "start"), "messages[0]")
        params = parse_stream_start(start, settings.limits, service.has_voice, 4 * CHUNK_BYTES)
        params = dataclasses.replace(params, voice=settings.voice_aliases.resolve(params.voice, service.has_voice))
        references = await asyncio.to_thread(service.references_of, params)
        service.check_stream_options(params)
        slots = text_stream_slot(websocket, service)
        try:
            await _run_text_stream(websocket, service, params, references, settings)
        finally:
            slots.release()


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
                held = put_when_speakable(run, held, piece)  # spoken from the first piece with something to say
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
    if not text_stream_ended(service, outcome, first):
        return
    try:
        await websocket.send_json({"type": "done", "frames": frames, "chunks": chunks, "seed": seed})
        await websocket.close(code=1000)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass  # the client left after the last audio

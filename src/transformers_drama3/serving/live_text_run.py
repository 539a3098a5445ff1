"""A text stream running for a WebSocket client: `model.stream_text` (`SpeechService.text_stream`)
in a worker thread, text pieces in, audio and per-chunk events out. Both text-stream routes run
through it: `/v1/audio/speech/stream` (JSON messages) and Fish Audio's `/v1/tts/live` (MessagePack
events), each with its own messages around it.

    run = TextStreamRun(service, params, references, seed, timeout, audio=pcm16)
    run.start()
    run.put("Good morning"); run.put(" to you."); run.end()      # from the route's receiving task
    while not isinstance(item := await run.next(), Finished):    # the route's sending task
        ...                                                       # bytes of audio, ChunkStarted, ChunkSpoken

The text may come in segments: `flush()` ends the current one, which is spoken to its end (its last
chunk without waiting for more text), and the pieces after it start the next, as a new text stream
from the voice's system turn (segment i draws with seed + i). A client that goes away (`cancel()`)
or a run past its time limit stops the worker at its next frame or piece.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np

from ..codec.take_audio import AudioChunk
from ..decoding import torch_threads
from ..generation.live_text import ChunkSpoken, ChunkStarted, TextStreamCancelled
from .protocol import RETRY_AFTER_SECONDS, ApiError, TextStreamParams, damaged_adapter
from .routing import AdapterError, AdapterSlotsBusy

POLL_SECONDS = 0.25
"""How often a worker waiting for text looks whether it should stop."""

_END, _FLUSH, _CANCEL = object(), object(), object()
CANCELLED = "cancelled"
"""`Finished.outcome` of a run whose client went away."""


@dataclass
class Finished:
    """The run has ended: `outcome` None when its text was spoken to the end, `CANCELLED` when its
    client went away, else the ApiError that ended it (504 past its time limit, 429, 409, 400, 500)."""

    outcome: object = None


class TextStreamRun:
    """One text stream in a worker thread (module docstring). `audio(samples [n] float32) -> item`
    turns each chunk of audio into what `next()` hands on (in the worker thread: encoding stays
    off the event loop; None hands on nothing); `first_window`: frames of each turn's first audio
    chunk (`stream_text`). Errors are named as `/v1/audio/speech` names them; `unexpected(error,
    where)` makes the ApiError of a failure no check foresaw (logged by the route)."""

    def __init__(self, service, params: TextStreamParams, references, seed: int, timeout: float,
                 audio: Callable[[np.ndarray], object], unexpected: Callable[[Exception, str], ApiError],
                 first_window: int | None = None):
        self.service, self.params, self.references, self.seed = service, params, references, seed
        self.audio, self.unexpected, self.first_window = audio, unexpected, first_window
        self.deadline = time.perf_counter() + timeout
        self.pieces: queue.Queue = queue.Queue()
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.cancelled, self.timed_out = threading.Event(), threading.Event()
        self.segments = 0
        self.worker: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- the route's side ------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.worker = asyncio.ensure_future(asyncio.to_thread(self._work))

    def put(self, piece: str) -> None:
        self.pieces.put(piece)

    def flush(self) -> None:
        """End the current segment: it is spoken to its end without waiting for more text."""
        self.pieces.put(_FLUSH)

    def end(self) -> None:
        """The text has ended."""
        self.pieces.put(_END)

    def cancel(self) -> None:
        """Stop the worker at its next frame or piece (the client went away, or the route failed)."""
        self.cancelled.set()
        self.pieces.put(_CANCEL)

    async def fail(self, error: ApiError) -> None:
        """End the run with `error` (a bad message from the client): the worker stops, and `next()`
        hands on `Finished(error)` before anything the worker makes after it."""
        self.cancel()
        await self.outbox.put(Finished(error))

    async def next(self):
        """The next item: what `audio` made of a chunk, a `ChunkStarted` / `ChunkSpoken`, or `Finished`."""
        return await self.outbox.get()

    async def join(self) -> None:
        """Stop the worker (a no-op once it has finished) and wait for it."""
        self.pieces.put(_CANCEL)
        if self.worker is not None:
            await self.worker

    # ---- the worker's side -----------------------------------------------------------------------

    def _stop(self) -> bool:
        if time.perf_counter() > self.deadline:
            self.timed_out.set()
        return self.cancelled.is_set() or self.timed_out.is_set()

    def _next_piece(self):
        """The next piece, `_FLUSH` or `_END`; raises TextStreamCancelled when the run should stop."""
        while True:
            try:
                piece = self.pieces.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._stop():
                    raise TextStreamCancelled("the text stream was cancelled") from None
                continue
            if piece is _CANCEL:
                raise TextStreamCancelled("the text stream was cancelled")
            return piece

    def _segment(self, ended: list):
        """The pieces of one segment, up to a flush or the end (then `ended` gets True)."""
        while True:
            piece = self._next_piece()
            if piece is _END:
                ended.append(True)
                return
            if piece is _FLUSH:
                return
            yield piece

    def _send(self, item) -> None:
        self._loop.call_soon_threadsafe(self.outbox.put_nowait, item)

    def _work(self) -> None:
        outcome = None
        try:
            # the whole stream, its codec's decodes included, at the service's codec thread count, as
            # every take is decoded: this pool thread's own count would round the audio differently
            with torch_threads(self.service.codec_threads):
                ended: list = []
                while not ended:
                    first = self._next_piece()
                    if first is _END:
                        break
                    if first is _FLUSH:  # a segment without text
                        continue
                    pieces = chain((first,), self._segment(ended))
                    for item in self.service.text_stream(self.params, self.references, self.seed + self.segments,
                                                         pieces, self._stop, first_window=self.first_window):
                        self._hand_on(item)
                    self.segments += 1
        except TextStreamCancelled:
            outcome = ApiError(504, "the text stream ran past its time limit", None, "timeout") if self.timed_out.is_set() \
                else CANCELLED
        except AdapterSlotsBusy as error:  # as /v1/audio/speech answers it: 429, retry shortly
            outcome = ApiError(429, str(error), "voice", "adapter_slots_busy", {"Retry-After": str(RETRY_AFTER_SECONDS)})
        except AdapterError as error:
            outcome = damaged_adapter(self.params.voice, error)
        except ValueError as error:
            outcome = ApiError(400, str(error), "text")
        except Exception as error:  # a failed stream fails its client, not the server
            outcome = self.unexpected(error, "a text stream")
        self._send(Finished(outcome))

    def _hand_on(self, item) -> None:
        if isinstance(item, AudioChunk):
            samples = item.audio.detach().cpu().float().numpy() if item.audio is not None else np.zeros(0, np.float32)
            made = self.audio(samples) if samples.size else None
            if made is not None:
                self._send(made)
        elif isinstance(item, (ChunkStarted, ChunkSpoken)):
            self._send(item)

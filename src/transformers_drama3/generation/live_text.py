"""Streaming text input: speak text while it is still arriving (an LLM's tokens, a live caption).

    for item in model.stream_text(llm_tokens, processor=processor, references=refs, codec=processor.codec):
        if isinstance(item, AudioChunk):
            play(item.audio)            # waveform of a few frames, as soon as they are final
        else:
            show(item)                  # ChunkStarted / ChunkSpoken: which text, and its delays

The text pieces are cut into the chunks `StreamingScript.from_text(whole text)` makes, each as soon
as it is final (`prompting.TextStreamChunker`). Turn k of the streaming layout holds chunk k and,
after `<|interleave|>`, chunk k + 1 as look-ahead (nothing once the text has ended), so chunk k is
spoken as soon as chunk k + 1 is final or the text has ended: its audio starts before chunk k + 2
exists.

The prompt is never built again. The system turn (the references) is prefilled once, before the
first piece is read; each turn then *extends* the cache with its rows (`model.extend`: the
backbone's Gated DeltaNet and attention layers continue from their state, the tower is
teacher-forced from the open row), and the take is drawn by the decode step of `generate()`
(`decoding.loop.DecodeRun`, continued turn by turn). The rows the cache holds after turn k are those of `StreamingScript(chunks,
references, spoken=takes)`: greedy output equals generating each turn from those rows from
scratch (the reference path), frame for frame, within float rounding of a chunked prefill.

What the context keeps of a take is the take as drawn (`ChunkSpoken.take`): when a take ends with
a `<|semantic:0|>` frame right before eos, the audio drops that frame (as `generate()` drops it),
but the cache already holds it, and a hybrid cache cannot take a row back.

Turn k samples with its own key, from the seed `seed + k * SEED_STRIDE`: `generate(seed=that)` on
the turn's rows draws the same numbers. Budgets are `generate()`'s, from the text of the turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from ..codec.take_audio import AudioChunk, ClickFilter, WaveformStreamer
from ..decoding.loop import DecodeRun, FrameStep
from ..decoding.request import RequestOptions, make_sampler, resolve_decoding, resolve_request, resolve_settings
from ..decoding.sampler import RAS_WINDOW, SEED_STRIDE, SamplingSettings
from ..generation_drama3 import _split_kwargs, check_codec_matches
from ..prompting import (
    CHUNK_BYTES,
    CHUNK_SPEAKERS,
    Reference,
    StreamingScript,
    StreamingSystemTurn,
    StreamingTurn,
    TextChunk,
    TextStreamChunker,
    as_reference,
    render_lines,
)


class TextStreamCancelled(Exception):
    """Raised by `stream_text` when its `stop()` says so (a client went away)."""


@dataclass
class ChunkStarted:
    """Turn `index` starts: chunk `index` is spoken now.

    text: the chunk (its lines by the structured-line convention); look_ahead: the chunk after it
    ("" once the text has ended); piece: the index of the text piece that made the chunk final;
    final_at: seconds from the first piece to that piece's arrival; started_at: seconds from the
    first piece to the start of the turn (its look-ahead known and the turn before it spoken)."""

    index: int
    text: str
    look_ahead: str
    piece: int
    final_at: float
    started_at: float


@dataclass
class ChunkSpoken:
    """Turn `index` ended.

    first_audio_at: seconds from the first piece to the first audio chunk holding this turn's
    frames (None when it made none); delay: from the arrival of the piece that made the chunk
    final to that first audio; frames: frames heard; take: codes [frames, num_codebooks] as drawn,
    what the context keeps (a click frame before eos included); finish_reason: "eos" or "length";
    budget: frames the turn was allowed."""

    index: int
    text: str
    piece: int
    final_at: float
    started_at: float
    first_audio_at: float | None
    frames: int
    take: torch.Tensor
    finish_reason: str
    budget: int

    @property
    def delay(self) -> float | None:
        return None if self.first_audio_at is None else self.first_audio_at - self.final_at


@dataclass
class _Stream:
    """The state of one text stream: the cache, the text so far and the clock."""

    chunker: TextStreamChunker
    pieces: Iterator
    started: float | None = None
    ended: bool = False
    final_at: dict[int, float] = field(default_factory=dict)

    def now(self) -> float:
        return time.perf_counter() - self.started

    def pull(self) -> list[TextChunk]:
        """Read one more piece (or the end of the text); returns the chunks it made final, and
        notes when (seconds from the first piece)."""
        try:
            piece = next(self.pieces)
        except StopIteration:
            self.ended = True
            chunks = self.chunker.finish()
        else:
            if self.started is None:
                self.started = time.perf_counter()
            chunks = self.chunker.feed(piece)
        for chunk in chunks:
            self.final_at[chunk.index] = self.now()
        return chunks


def _turn_seed(seed: int | None, turn: int) -> int | None:
    return None if seed is None else seed + turn * SEED_STRIDE


def _turn_request(model, recent: torch.Tensor, speak_span: tuple[int, int], options: RequestOptions):
    """The decode request of one turn: its RAS window is the last main tokens of the whole context
    (`recent` [1, RAS_WINDOW or fewer], the turn's rows last), its budget is `generate()`'s from the
    text of the turn (`speak_span` counts the turn's rows, which the resolver reads for their number of
    text tokens)."""
    return resolve_request(model, recent, torch.ones_like(recent), options, {"speak_span": torch.tensor([speak_span])})


@torch.no_grad()
def stream_text(
    model,
    text_pieces: Iterable[str],
    *,
    processor,
    references: Sequence[Reference] = (),
    codec=None,
    seed: int | None = None,
    preset: str | SamplingSettings | None = None,
    generation_config: GenerationConfig | None = None,
    max_bytes: int = CHUNK_BYTES,
    max_speakers: int = CHUNK_SPEAKERS,
    strict_speakers: bool = True,
    stop: Callable[[], bool] | None = None,
    first_window: int | None = None,
    **kwargs,
) -> Iterator[AudioChunk | ChunkStarted | ChunkSpoken]:
    """Speak text pieces as they arrive; yields audio chunks and per-chunk events (module docstring).

    Args:
        text_pieces: any iterable of str (tokens, words, sentences), joined as given; read lazily,
            one piece at a time, only when the next turn needs more text.
        processor: the model's `Drama3Processor` (its tokenizer writes the rows, its codec encodes
            reference audio).
        references: voice references (`Reference`), checked and prefilled before any text is read.
        codec: decodes frames to audio (usually `processor.codec`); without it each `AudioChunk`
            holds one frame's codes and no audio.
        seed, preset, generation_config, **kwargs: sampling as in `generate()` (`do_sample=False`
            is greedy); `max_new_tokens` caps each turn; `cache_implementation="static"` /
            `compile_config` compile the decode step as in `generate()` (the cache grows from one
            length class to the next between turns).
        max_bytes, max_speakers: chunk limits (default the published ~300 bytes, 3 speakers);
            smaller chunks start speaking sooner.
        strict_speakers: with references, refuse a chunk whose speaker has none.
        stop: called between frames and pieces; when it returns True the stream raises
            `TextStreamCancelled` (a server's client went away).
        first_window: frames of each turn's first audio chunk (None: the codec's schedule, 10);
            fewer start its audio sooner, in more pieces (`WaveformStreamer`). The audio is the same.

    Yields: `ChunkStarted` when a turn starts, `AudioChunk`s (`first_frame` counts frames across
    the whole stream; `is_last` on the very last one), `ChunkSpoken` when a turn ends. Bad input is
    refused as the batch API refuses it: a non-str piece names its index, text errors (spelled
    special tokens, bad tags) are raised as soon as the text holding them is settled, and empty text
    at the end.
    """
    check_codec_matches(model.config, codec)
    overrides = _split_kwargs(kwargs, "stream_text()")
    settings, max_new_tokens, _ = resolve_settings(getattr(model, "generation_config", None), preset, generation_config, overrides)
    compile_config = resolve_decoding(model, generation_config, overrides).compile_config
    references = tuple(as_reference(reference, f"references[{index}]") for index, reference in enumerate(references))
    device = model.device
    system = processor.rows(StreamingSystemTurn(references))
    ids = system.input_ids[None].to(device)
    run = DecodeRun.prefilled(
        model, ids, system.audio_codes[None].to(device), torch.ones_like(ids), None, torch.zeros(1, dtype=torch.long),
        compile_config=compile_config,
    )
    recent = ids[:, -RAS_WINDOW:]  # the last main ids of the rows: the RAS window of the next turn
    stream = _Stream(TextStreamChunker(max_bytes, max_speakers), iter(text_pieces))
    streamer = WaveformStreamer(codec, 0.0, first_window=first_window)
    chunks: list[TextChunk] = []
    last_step = None  # the last decode step of the previous turn
    turn = 0
    while True:
        while not stream.ended and len(chunks) < turn + 2:
            _check_stop(stop)
            chunks += stream.pull()
        if turn >= len(chunks):
            return
        if turn == 0:
            streamer.started = stream.started
        script = StreamingScript([chunk.lines for chunk in chunks[: turn + 2]], references, strict_speakers=strict_speakers)
        rows = processor.rows(StreamingTurn(script, turn))
        if last_step is not None and not bool(last_step.eos[0]):
            run.feed_last_frame(last_step)
        ids = rows.input_ids[None].to(device)
        run.extend(ids, rows.audio_codes[None].to(device))
        recent = _recent(recent, ids)
        look_ahead = render_lines(chunks[turn + 1].lines) if turn + 1 < len(chunks) else ""
        started = ChunkStarted(
            turn, render_lines(chunks[turn].lines), look_ahead, chunks[turn].piece, stream.final_at[turn], stream.now()
        )
        yield started
        request = _turn_request(model, recent, rows.speak_span, RequestOptions(settings, _turn_seed(seed, turn), max_new_tokens))
        drawn = _Turn(int(request.budgets[0]))
        last_turn = stream.ended and turn + 1 == len(chunks)
        run.next_turn(make_sampler(model, request), request.budgets)
        yield from _speak_turn(run, streamer, stream, stop, last_turn, drawn)
        last_step = drawn.last_step
        take = drawn.codes(model.config.num_codebooks, device)
        recent = _recent(recent, take[:, 0][None] + model.config.semantic_start_token_id)
        yield ChunkSpoken(
            turn, started.text, started.piece, started.final_at, started.started_at, drawn.first_audio_at,
            drawn.heard, take, "eos" if bool(last_step.eos[0]) else "length", drawn.budget,
        )
        turn += 1


@dataclass
class _Turn:
    """What one turn drew: its frames as drawn, the frames sent out as audio, when the first
    audible chunk came out (seconds from the first piece), and its last decode step."""

    budget: int
    frames: list[torch.Tensor] = field(default_factory=list)
    heard: int = 0
    first_audio_at: float | None = None
    last_step: FrameStep | None = None

    def sent(self, chunk: AudioChunk, now: float) -> None:
        self.heard += chunk.codes.shape[0] if chunk.codes.numel() else 0
        audible = chunk.codes.numel() and (chunk.audio is None or chunk.audio.numel())
        if audible and self.first_audio_at is None:
            self.first_audio_at = now

    def codes(self, num_codebooks: int, device) -> torch.Tensor:
        """The take as drawn: [frames, num_codebooks] on `device` (a step's frames are on the host)."""
        if not self.frames:
            return torch.zeros(0, num_codebooks, dtype=torch.long, device=device)
        return torch.stack(self.frames).to(device)


def _speak_turn(run: DecodeRun, streamer, stream, stop, last_turn: bool, drawn: _Turn) -> Iterator[AudioChunk]:
    """Draw one turn's take from the run's open row (the decode step of `generate()`) and yield its
    audio; the turn's audio ends with it (the stream's last chunk after the last turn)."""
    clicks = ClickFilter()
    for step in run.steps():
        _check_stop(stop)
        if bool(step.produced[0]):
            drawn.frames.append(step.frames[0])
        drawn.last_step = step
        for chunk in streamer.step(clicks, step):
            drawn.sent(chunk, stream.now())
            yield chunk
    for chunk in streamer.finish() if last_turn else streamer.end_window():
        drawn.sent(chunk, stream.now())
        yield chunk


def _check_stop(stop: Callable[[], bool] | None) -> None:
    if stop is not None and stop():
        raise TextStreamCancelled("the text stream was cancelled")


def _recent(recent: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The last `RAS_WINDOW` main ids of the rows so far, after `ids` [1, rows] are added."""
    return torch.cat((recent, ids.to(recent.device)), dim=1)[:, -RAS_WINDOW:]


class Drama3TextStreamingMixin:
    """`stream_text` as a method of `Drama3ForSpeechGeneration` (which inherits it)."""

    def stream_text(self, text_pieces: Iterable[str], processor, **kwargs):
        """Speak text pieces as they arrive. See `generation.live_text.stream_text`."""
        return stream_text(self, text_pieces, processor=processor, **kwargs)

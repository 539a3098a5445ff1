"""The demo's director: what the Gradio page does, without the page. It loads a backend (a
`SpeechService`, on ZeroGPU stepped inside the GPU call), checks what a user typed and chose,
speaks a scene one engine job per request (or per speaker turn), revises a take with a director's
note and feeds a text word by word to `model.stream_text`. The page around it is `serving.demo`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import numpy as np
import torch

from ..output_files import atomic_output
from ..codec.take_audio import AudioChunk, WaveformStreamer
from ..decoding import DEMO, options_for
from ..generation.live_text import ChunkSpoken, ChunkStarted
from ..runtime.loading import resolve_device
from ..runtime.long_form import resolve_scene_mode
from ..prompting import CHUNK_BYTES, Reference, Script, parse_text, revision, speaker_turns
from .service import SpeechService, chunk_samples, driven_events
from .audio_formats import encode
from .engine import EngineStopped, ErrorEvent, FramesEvent, QueueFull
from .protocol import MIN_CHUNK_BYTES, Limits, TextStreamParams
from .voices import VoiceReference

MODEL_VARIABLE = "DRAMA3_MODEL"
"""The environment variable that names the model to demo (a folder or a Hub repo); unset: drama3-tiny."""

SPEAKERS = 4
"""Speakers the voice panel offers (0 to SPEAKERS - 1)."""

OWN_CLIP = "my clip"
"""The voice choice that clones a speaker from the clip (upload or microphone) given beside it."""

PRESETS = {"model default": None, "serving": "serving", "paper evaluation": "paper-eval"}
"""Sampling presets: the model's generation config, or `generate()`'s presets."""

TAKE_OPTIONS = options_for(DEMO)
"""The request options the sampling panel offers, one field each (`decoding.options`, the demo's door)."""
OPTIONS_BY_NAME = {option.name: option for option in TAKE_OPTIONS}

INSERTS = (
    ("speaker 0", "<|speaker:0|> "), ("speaker 1", "<|speaker:1|> "), ("[pause]", "[pause] "),
    ("[laughs]", "[laughs] "), ("[sighs]", "[sighs] "), ("<whisper>", "<whisper>quietly</whisper> "),
    ("<emphasis>", "<emphasis>this</emphasis> "),
)
"""The chips above the script: (label, text appended to the script)."""

EXAMPLES = (
    ("<|speaker:0|> Did you hear that? [pause] Something moved downstairs.\n"
     "<|speaker:1|> It is only the wind. Go back to sleep.", "hushed, late at night", "A", "B"),
    ("<|speaker:0|> Good morning to you. [laughs] What a lovely day it is.", "", "B", "A"),
    ("<|speaker:0|> We have to leave now.\n<|speaker:1|> Not without the others.\n"
     "<|speaker:0|> Then hurry.", "urgent", "B", "A"),
)
"""Ready scripts: (script, director's note, voice of speaker 0, voice of speaker 1)."""

GPU_SECONDS = 120
"""The GPU time a ZeroGPU Space grants one take."""

LICENCE_NOTICE = (
    "Built with Fish Audio. The published Drama 3 weights and the S2 codec are licensed under the "
    "Fish Audio Research License (research and non-commercial use). drama3-tiny, the small default "
    "model, is trained by transformers-drama3 on espeak-ng speech and is a demonstration, not a voice."
)


# ---- the backend --------------------------------------------------------------------------------


def threaded_events(handle):
    """A request's events as the engine's scheduler thread sends them."""
    return handle.events()


@dataclass
class Backend:
    """What the app speaks with: the service, how a request's events are read (`threaded_events`,
    or `driven_events` where the caller steps the engine), how many requests the page lets run at
    once (the engine decodes them in one batch) and how long one request may take (seconds)."""

    service: SpeechService
    events: Callable = threaded_events
    concurrency: int = 4
    timeout: float = 600.0


def on_zero_gpu() -> bool:
    """Whether this runs on ZeroGPU hardware (Hugging Face sets SPACES_ZERO_GPU there)."""
    return os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "true")


def spaces_gpu() -> Callable | None:
    """Hugging Face's `spaces.GPU` where its `spaces` package is installed (on a Space), else None.
    (A folder named spaces/ on the path, such as this repository's, imports without it.)"""
    try:
        import spaces
    except ImportError:
        return None
    return getattr(spaces, "GPU", None)


def gpu_call(function: Callable) -> Callable:
    """`function` wrapped with `spaces.GPU` where that exists (ZeroGPU lends the GPU for the call;
    other Space hardware ignores it); unchanged elsewhere."""
    decorator = spaces_gpu()
    return function if decorator is None else decorator(duration=GPU_SECONDS)(function)


def load_backend(model: str | None = None, device: str = "auto", max_batch: int = 4, adapter_specs=()) -> Backend:
    """Load the model once: `model`, else `$DRAMA3_MODEL`, else the bundled drama3-tiny; with
    `adapter_specs` ("NAME=PATH"), fine-tuned voices on it (`SpeechService.load`).

    Voices given in the page are kept in memory and in a temporary folder, never shared."""
    source = model or os.environ.get(MODEL_VARIABLE) or None
    voices_dir = tempfile.mkdtemp(prefix="drama3-demo-voices-")
    driven = on_zero_gpu()
    if driven and device == "auto":
        device = "cuda"  # ZeroGPU: weights are placed on the GPU at start, used inside `gpu_call`s
    service = SpeechService.load(source, voices_dir, device=resolve_device(device), max_batch=max_batch,
                                 start_engine=not driven, adapter_specs=adapter_specs)
    if driven:  # one caller steps the engine at a time
        return Backend(service, events=lambda handle: driven_events(service.engine, handle), concurrency=1)
    return Backend(service, concurrency=max_batch)


# ---- what the page asks for ---------------------------------------------------------------------


@dataclass(frozen=True)
class VoiceChoice:
    """One speaker's voice in the panel: a bundled voice id or `OWN_CLIP` (then the clip, as
    gradio gives it, (rate, samples [samples] or [samples, channels]), and its transcript)."""

    speaker: int
    voice: str | None
    clip: tuple | None = None
    transcript: str = ""

    @property
    def label(self) -> str:
        """How the page names this speaker's fields."""
        return f"Speaker {self.speaker}"


@dataclass(frozen=True)
class TakeSettings:
    """How a take is drawn: the preset (None: the model's config), the options the panel set (name
    -> checked value, `TAKE_OPTIONS`; the seed apart) and the seed (drawn when the panel gave none)."""

    preset: str | None
    options: dict
    seed: int


@dataclass(frozen=True)
class SpokenRequest:
    """One engine request of a take: the script's speaker (None when the scene is spoken jointly),
    the request, and its codes [frames, num_codebooks] and finish reason once spoken."""

    speaker: int | None
    request: Script
    prefix: object = None
    codes: torch.Tensor | None = None
    finish_reason: str | None = None
    adapter: str | None = None  # the fine-tuned voice (LoRA adapter) it speaks with, if any


@dataclass(frozen=True)
class SceneTake:
    """A take of the whole script: its requests in order, and its number (1, then one more per revision)."""

    requests: tuple[SpokenRequest, ...]
    number: int = 1

    def revised(self, note: str) -> list[SpokenRequest]:
        """The requests that revise this take: each asked again with its take in context."""
        return [
            SpokenRequest(spoken.speaker, revision(spoken.request, spoken.codes.T, note), spoken.prefix,
                          adapter=spoken.adapter)
            for spoken in self.requests
        ]


@dataclass
class TakeUpdate:
    """What a take streams to the page: a waveform chunk [samples] as it is made, the progress
    (frames so far, the request being spoken), and at the end the take and its file."""

    audio: np.ndarray | None = None
    frames: int = 0
    request: int = 0
    take: SceneTake | None = None
    path: str | None = None
    report: str = ""


WORDS_PER_SECOND = (0.5, 50.0)
"""The feed rates the "Speak as it arrives" tab offers (words per second; people speak ~2.5)."""


class ArrivingText:
    """A text released one word at a time on a clock, as a language model streams its tokens:
    word i (with the spaces after it) arrives `i / words_per_second` seconds after the first word
    is asked for. Iterating waits for each word's arrival, so whoever reads it (`stream_text`)
    cannot see a word before it exists."""

    def __init__(self, text: str, words_per_second: float, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self.words = tuple(re.findall(r"\S+\s*", text.strip()))
        self.words_per_second = words_per_second
        self.clock, self.sleep = clock, sleep
        self.started: float | None = None
        self.read = 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if self.read == len(self.words):
            raise StopIteration
        if self.started is None:
            self.started = self.clock()
        wait = self.started + self.arrival(self.read) - self.clock()
        if wait > 0:
            self.sleep(wait)
        self.read += 1
        return self.words[self.read - 1]

    def arrival(self, index: int) -> float:
        """Seconds from the first word to the arrival of word `index`."""
        return index / self.words_per_second

    def now(self) -> float:
        """Seconds since the first word arrived (0 before it)."""
        return 0.0 if self.started is None else self.clock() - self.started

    def arrived(self) -> int:
        """Words arrived by now (whether or not the model has read them yet)."""
        if self.started is None:
            return 0
        return min(len(self.words), math.floor(self.now() * self.words_per_second) + 1)


@dataclass
class ArrivalUpdate:
    """What the "Speak as it arrives" tab streams: a waveform chunk [samples], the words arrived,
    the chunks spoken so far (`ChunkSpoken`, or `ChunkStarted` for the one being spoken), and at
    the end the whole take's file and a report."""

    audio: np.ndarray | None
    arrived: int
    chunks: list
    path: str | None = None
    report: str = ""


def bad_input(message: str) -> gr.Error:
    """An error the page shows as a message naming the field (never a stack trace)."""
    return gr.Error(message, print_exception=False)


def clip_samples(clip: tuple, field_name: str) -> tuple[np.ndarray, int]:
    """gradio's (rate, samples) of an upload or a recording -> mono float32 samples in [-1, 1], rate."""
    rate, samples = clip
    samples = np.asarray(samples)
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    if np.issubdtype(samples.dtype, np.integer):  # scaled as soundfile reads integer PCM
        samples = samples.astype(np.float32) / -float(np.iinfo(samples.dtype).min)
    if samples.size == 0:
        raise bad_input(f"{field_name} clip: the recording is empty")
    return samples.astype(np.float32), int(rate)


class Director:
    """Turns the page's fields into engine requests and speaks them (no gradio widgets here:
    the handlers below and the tests call it)."""

    def __init__(self, backend: Backend, limits: Limits | None = None):
        self.backend, self.service = backend, backend.service
        self.limits = limits or Limits()
        self.takes_dir = Path(tempfile.mkdtemp(prefix="drama3-demo-takes-"))

    @property
    def voice_names(self) -> list[str]:
        """The stored voices and the fine-tuned ones (adapters), by id."""
        return [voice["id"] for voice in self.service.voice_listing()]

    # ---- checks and requests (every problem raises a gr.Error naming its field) -------------------

    def script(self, text: str, note: str, voices: list[VoiceChoice]) -> Script:
        """The checked script with every speaker's references; `note` goes before each line."""
        if not text or not text.strip():
            raise bad_input("Script: nothing to say; type a line, e.g. <|speaker:0|> Hello there.")
        if len(text) > self.limits.max_input_chars:
            raise bad_input(f"Script: {len(text)} characters; at most {self.limits.max_input_chars}")
        try:
            lines = parse_text(text, "Script")
        except ValueError as error:
            raise bad_input(str(error)) from None
        speakers = sorted({line.speaker for line in lines})
        if speakers[-1] >= len(voices):
            raise bad_input(f"Script: speaker {speakers[-1]} has no voice; the demo voices speakers 0-{len(voices) - 1}")
        own = {speaker: self.references(voices[speaker]) for speaker in speakers}
        clipless = [speaker for speaker in speakers if not own[speaker]]
        if clipless and len(speakers) > 1:  # only a fine-tuned voice comes without clips
            choice = voices[clipless[0]]
            raise bad_input(f"{choice.label} voice: the fine-tuned voice {choice.voice!r} has no reference clip, which each "
                            "voice of a scene with several speakers needs; it speaks a script of its own")
        references = [reference for speaker in speakers for reference in own[speaker]]
        source = text  # spoken as written, unless a note rewrites every line
        if note and note.strip():
            try:
                source = tuple(dataclasses.replace(line, note=note.strip()).checked("Director's note") for line in lines)
            except ValueError as error:
                raise bad_input(str(error)) from None
        try:
            return Script(source, tuple(references))
        except ValueError as error:
            raise bad_input(f"Script: {error}") from None

    def references(self, choice: VoiceChoice) -> tuple[Reference, ...]:
        """A speaker's references, renumbered to its speaker: a bundled voice's, or its own clip's."""
        if choice.voice is None or choice.voice == "":
            raise bad_input(f"{choice.label} voice: the script gives this speaker lines; choose a voice or {OWN_CLIP!r}")
        if choice.voice != OWN_CLIP:
            if not self.service.has_voice(choice.voice):
                raise bad_input(f"{choice.label} voice: no voice {choice.voice!r}; choose one of {self.voice_names}")
            if choice.voice not in self.service.voices:
                return ()  # a fine-tuned voice without reference clips: its adapter speaks it
            return tuple(reference.renumbered(choice.speaker) for reference in self.service.voices.references(choice.voice))
        if choice.clip is None:
            raise bad_input(f"{choice.label} clip: upload or record a clip of this voice")
        if not choice.transcript or not choice.transcript.strip():
            raise bad_input(f"{choice.label} transcript: write what the clip says")
        samples, rate = clip_samples(choice.clip, choice.label)
        try:
            reference = self.service.voices.encode(
                VoiceReference(samples, rate, choice.transcript.strip(), choice.speaker), f"{choice.label} clip"
            )
        except ValueError as error:
            raise bad_input(str(error)) from None
        return (reference,)

    def scene_requests(self, script: Script, voices: list[VoiceChoice]) -> list[SpokenRequest]:
        """The engine requests of a script: one per speaker turn for a model that speaks scenes
        turn by turn (its generation config's `scene_mode`), else one."""
        keys = {choice.speaker: choice.voice for choice in voices if choice.voice not in (None, "", OWN_CLIP)}
        adapters = {speaker: self.service.adapter_of(voice) for speaker, voice in keys.items()}
        if resolve_scene_mode(self.service.model, None) == "joint":
            speakers = sorted({line.speaker for line in script.lines})
            prefix = tuple(keys.get(speaker) for speaker in speakers)
            adapter = adapters.get(speakers[0])
            if len(speakers) > 1 and any(adapters.get(speaker) for speaker in speakers):
                raise bad_input("Script: this model speaks a scene in one request, which takes one voice's adapter; a "
                                "fine-tuned voice can speak a one-speaker script here")
            return [SpokenRequest(None, script, None if None in prefix else prefix, adapter=adapter)]
        try:
            turns = speaker_turns(script)
        except ValueError as error:
            raise bad_input(f"Script: {error}") from None
        return [SpokenRequest(speaker, request, keys.get(speaker), adapter=adapters.get(speaker)) for speaker, request in turns]

    def revision_requests(self, take: SceneTake | None, note: str) -> list[SpokenRequest]:
        if take is None:
            raise bad_input("Revision note: there is no take to revise yet; generate one first")
        if not note or not note.strip():
            raise bad_input("Revision note: say what to change, e.g. slower, more tired")
        try:
            return take.revised(note.strip())
        except ValueError as error:
            raise bad_input(f"Revision note: {error}") from None

    def arriving_text(self, text: str, words_per_second, chunk_bytes) -> ArrivingText:
        """The checked text of the "Speak as it arrives" tab, as a feed (speaker 0 only: one voice)."""
        if not text or not text.strip():
            raise bad_input("Text: nothing to say; type or paste a few sentences")
        if len(text) > self.limits.max_input_chars:
            raise bad_input(f"Text: {len(text)} characters; at most {self.limits.max_input_chars}")
        try:
            lines = parse_text(text, "Text")
        except ValueError as error:
            raise bad_input(str(error)) from None
        others = sorted({line.speaker for line in lines} - {0})
        if others:
            raise bad_input(f"Text: speaker {others[0]} has no voice here; this tab speaks with one voice (speaker 0)")
        low, high = WORDS_PER_SECOND
        if words_per_second is None or not low <= words_per_second <= high:
            raise bad_input(f"Words per second: {words_per_second!r}; expected {low} to {high}")
        if chunk_bytes is None or not MIN_CHUNK_BYTES <= chunk_bytes <= CHUNK_BYTES:
            raise bad_input(f"Chunk size: {chunk_bytes!r}; expected {MIN_CHUNK_BYTES} to {CHUNK_BYTES} bytes")
        return ArrivingText(text, float(words_per_second))

    def speak_as_it_arrives(self, feed: ArrivingText, voice: VoiceChoice, settings: TakeSettings,
                            chunk_bytes: int) -> Iterator[ArrivalUpdate]:
        """Feed the text to `model.stream_text` as it arrives (the server's text-stream path) and
        stream its audio; chunk k is spoken once chunk k + 1 is known, while later words arrive."""
        references = self.references(voice)
        params = TextStreamParams(
            model=None, voice=self.service.adapter_of(voice.voice), response_format="pcm",
            options={**settings.options, "seed": settings.seed}, chunk_bytes=int(chunk_bytes),
        )
        heard, chunks = [], []
        started = time.perf_counter()
        items = self.service.text_stream(params, references, settings.seed, feed, None, preset=settings.preset)
        try:
            for item in items:
                audio = None
                if isinstance(item, ChunkStarted):
                    chunks.append(item)
                elif isinstance(item, ChunkSpoken):
                    chunks[-1] = item
                elif isinstance(item, AudioChunk) and item.audio is not None and item.audio.numel():
                    audio = item.audio.detach().cpu().float().numpy()
                    heard.append(audio)
                yield ArrivalUpdate(audio, feed.arrived(), list(chunks))
        except ValueError as error:  # text the whole-text checks cannot see (e.g. a chunk the layout refuses)
            raise bad_input(f"Text: {error}") from None
        waveform = np.concatenate(heard) if heard else np.zeros(0, dtype=np.float32)
        report = self.arrival_report(feed, chunks, waveform, time.perf_counter() - started)
        yield ArrivalUpdate(None, feed.arrived(), chunks, self.save(waveform, 1), report)

    def arrival_report(self, feed: ArrivingText, chunks: list, waveform: np.ndarray, elapsed: float) -> str:
        """When the first audio came against when the text arrived, and the real-time factor."""
        seconds = waveform.size / self.service.processor.sampling_rate
        first = next((chunk.first_audio_at for chunk in chunks if chunk.first_audio_at is not None), None)
        last_word = feed.arrival(len(feed.words) - 1)
        if first is None:
            timing = "no audio"
        elif first < last_word:
            timing = f"first audio at {first:.2f} s, before the text was complete (its last word arrived at {last_word:.2f} s)"
        else:
            timing = f"first audio at {first:.2f} s, after the whole text (its last word arrived at {last_word:.2f} s)"
        factor = f"{elapsed / seconds:.2f}" if seconds else "n/a"
        return f"**{len(chunks)} chunks**, {seconds:.2f} s of audio: {timing} · real-time factor {factor}"

    def settings(self, preset: str, **values) -> TakeSettings:
        """How a take is drawn: `preset` (a label of `PRESETS`) and the panel's fields by option name
        (`TAKE_OPTIONS`), each checked by the option schema's one check; an empty field (None or "")
        leaves its option to the preset or the model. No seed: a random one, shown with the take so it
        can be drawn again."""
        if preset not in PRESETS:
            raise bad_input(f"Preset: {preset!r}; choose one of {list(PRESETS)}")
        options = {}
        for option in TAKE_OPTIONS:
            value = values.get(option.name)
            if value is None or value == "":
                continue
            if option.kind is int and isinstance(value, float) and value.is_integer():
                value = int(value)  # a number field gives 30.0 for 30
            try:  # the one check of option values, as generate() and the server apply it
                option.check(value)
            except ValueError as error:
                raise bad_input(f"{option.demo_label}: {error}") from None
            options[option.name] = value
        frames = options.get("max_new_tokens")
        if frames is not None and frames > self.limits.max_new_tokens:
            raise bad_input(f"{OPTIONS_BY_NAME['max_new_tokens'].demo_label}: {frames!r}; at most {self.limits.max_new_tokens}")
        seed = options.pop("seed", None)
        return TakeSettings(PRESETS[preset], options, secrets.randbelow(2**31) if seed is None else seed)

    # ---- speaking --------------------------------------------------------------------------------

    def speak(self, requests: list[SpokenRequest], settings: TakeSettings, number: int) -> Iterator[TakeUpdate]:
        """Speak the requests in order, one engine job each (request k draws with seed + k), one
        waveform stream across them; the last update carries the take, its WAV file and a report."""
        service = self.service
        streamer = WaveformStreamer(service.processor.codec, time.perf_counter())
        started, first_audio, heard = time.perf_counter(), None, []
        spoken, frames = [], 0
        for index, item in enumerate(requests):
            job = self.job(item, settings, settings.seed + index)
            handle = self.submit(job)
            try:
                for event in self.backend.events(handle):
                    if isinstance(event, ErrorEvent):
                        raise gr.Error(f"The take failed ({event.kind}): {event.message}")
                    if isinstance(event, FramesEvent):
                        frames += event.frames.shape[0]
                        chunks = streamer.push(list(event.frames))
                    else:
                        spoken.append(dataclasses.replace(item, codes=event.codes, finish_reason=event.finish_reason))
                        chunks = streamer.finish() if index == len(requests) - 1 else []
                    for audio in chunk_samples(chunks):
                        first_audio = first_audio if first_audio is not None else time.perf_counter() - started
                        heard.append(audio)
                        yield TakeUpdate(audio=audio, frames=frames, request=index)
                    if not chunks:
                        yield TakeUpdate(frames=frames, request=index)
            finally:
                handle.cancel()  # a no-op once the request has ended; frees the slot when the page left
        waveform = np.concatenate(heard) if heard else np.zeros(0, dtype=np.float32)
        take = SceneTake(tuple(spoken), number)
        report = self.report(take, waveform, settings, first_audio, time.perf_counter() - started)
        yield TakeUpdate(frames=frames, request=len(requests) - 1, take=take, path=self.save(waveform, number), report=report)

    def job(self, item: SpokenRequest, settings: TakeSettings, seed: int):
        try:
            rows = self.service.processor(item.request)
        except ValueError as error:
            raise bad_input(f"Script: {error}") from None
        job = self.service.job_of_rows(rows, self.backend.timeout, {**settings.options, "seed": seed},
                                       preset=settings.preset, prefix=item.prefix)
        return dataclasses.replace(job, adapter=item.adapter)

    def submit(self, job):
        try:
            return self.service.engine.submit(job)
        except QueueFull:
            raise gr.Error("Too many takes are waiting; try again in a moment") from None
        except EngineStopped as error:
            raise gr.Error(f"The model is not running: {error}") from None

    def save(self, waveform: np.ndarray, number: int) -> str:
        """The take as a 16-bit WAV file (written whole, then renamed into place)."""
        path = self.takes_dir / f"take-{number}-{secrets.token_hex(4)}.wav"
        with atomic_output(path) as temporary:
            Path(temporary).write_bytes(encode(waveform, self.service.processor.sampling_rate, "wav"))
        return str(path)

    def report(self, take: SceneTake, waveform: np.ndarray, settings: TakeSettings, first_audio, elapsed: float) -> str:
        """Take number, length, time to first audio, real-time factor, seed and how each request ended."""
        seconds = waveform.size / self.service.processor.sampling_rate
        factor = f"{elapsed / seconds:.2f}" if seconds else "n/a"
        first = f"{first_audio:.2f} s" if first_audio is not None else "n/a"
        ends = ", ".join(spoken.finish_reason for spoken in take.requests)
        return (f"**Take {take.number}**: {seconds:.2f} s of audio · time to first audio {first} · "
                f"real-time factor {factor} · seed {settings.seed} · ended: {ends}")


# ---- the page -----------------------------------------------------------------------------------

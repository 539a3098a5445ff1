"""The speech service behind the server: the model, its processor, the engine, the voices and the
metrics, loaded together (`SpeechService.load`); a checked request -> an engine job, references
-> prompt rows, codes -> waveforms (at one codec thread count), a text stream over
`model.stream_text`. The HTTP and WebSocket routes around it are `serving.app`.
"""

from __future__ import annotations

import _thread
import dataclasses
import logging
import os
import sys
import threading

import numpy as np
import torch

from ..codec.take_audio import decode_audio
from ..decoding import default_compile_config, resolve_settings, torch_threads
from ..runtime.loading import load_model_and_processor
from ..prompting import CHUNK_BYTES, Reference, Script, parse_text
from ..tiny import shipped
from .engine import Drama3Engine, FramesEvent, SpeechJob
from .metrics import ServerMetrics
from .prefix_cache import PrefixCache
from .protocol import ApiError, SpeechParams, TextStreamParams
from .voices import DamagedVoice, VoiceStore, reference_file_voice, register_bundled_voices
from .routing import routed

logger = logging.getLogger(__name__)


class TextStreamSlots:
    """How many text streams may run at once, and how many do."""

    def __init__(self, limit: int):
        self.limit, self.active = limit, 0
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        with self._lock:
            if self.active >= self.limit:
                return False
            self.active += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.active -= 1


class SpeechService:
    """The model, processor, engine, voices and metrics behind the API."""

    def __init__(self, model, processor, voices: VoiceStore, model_name: str, engine: Drama3Engine,
                 metrics: ServerMetrics, default_voice: str | None, codec_threads: int | None = None,
                 adapters=None):
        self.model, self.processor, self.voices = model, processor, voices
        self.adapters = adapters  # fine-tuned voices: LoRA adapters on the model (None: the server takes none)
        self.model_name, self.engine, self.metrics = model_name, engine, metrics
        self.default_voice = default_voice
        # Every codec decode runs at one thread count (by default the creating thread's): torch keeps
        # the count per thread, the worker threads the decodes land on differ, and a float rounding
        # that differs with the count grows through Griffin-Lim's iterations to tens of LSB, so the
        # same codes (the same seed) would not always give the same samples.
        self.codec_threads = torch.get_num_threads() if codec_threads is None else codec_threads

    @classmethod
    def load(cls, source: str | None = None, voices_dir: str = "drama3-voices", device: str = "cpu",
             max_batch: int = 16, max_queue: int = 64, voice_specs=(), prefix_cache: bool = True,
             start_engine: bool = True, threads: int | str | None = "auto", compile: bool = False,
             adapter_specs=(), adapter_root: str | None = None, max_adapters: int = 8, adapter_rank: int = 16,
             quant: str | None = None, offload: int | None = None, prefill_chunk: int | None = None,
             prefill_share: float | None = None):
        """Load a model (default: the bundled drama3-tiny, with its voices A and B registered).

        `start_engine=False` leaves the engine without its scheduler thread, for a caller that
        steps it itself (`driven_events`: on a ZeroGPU Space the GPU exists only inside the call
        that asked for it). `threads`: the scheduler thread's decode threads (`Drama3Engine`).
        `compile`: the engine steps the compiled decode step (`decoding.loop.default_compile_config`:
        inductor, CUDA graphs on a GPU, torch's automatic dynamic shapes) in batch-size buckets: the
        first bucket compiles its own graph, the next one a graph with its sizes symbolic that every
        later bucket runs (batch 1 keeps its own); CUDA graphs record one graph per bucket.
        `adapter_specs` ("NAME=PATH", `--adapter`) are registered as voices at start; with them or an
        `adapter_root` (server folders adapters may be registered from at run time) the model gets
        `max_adapters` adapter slots of rank up to `adapter_rank` (`adapters.AdapterRegistry`), and
        uploaded adapters are kept in `voices_dir`/.adapters. `quant` (`--quant`): the weights loaded
        quantised (`checkpoint.quantization.WEIGHT_OPTIONS`); adapters need unquantised weights.
        `offload` (`--offload-experts K`): the routed experts in CPU RAM, K of each layer cached on
        `device` (`offload.offload_experts`); the engine then steps eagerly. `prefill_chunk`
        (`--prefill-chunk`): rows of prompt prefilled at most between two decode steps, in pieces of
        that many rows (`Drama3Engine`); None: `default_prefill_chunk(device)`. `prefill_share`
        (`--prefill-share`): while requests run, the largest fraction of the engine's time spent
        prefilling; None: the engine's default (`chunked_prefill.DEFAULT_PREFILL_SHARE`)."""
        if adapter_specs or adapter_root is not None:  # the adapter code loads only for a server given adapters
            from .adapters import AdapterRegistry, parse_adapter_spec
        named_adapters = [parse_adapter_spec(spec) for spec in adapter_specs]  # a bad flag is refused before loading
        bundled = source is None
        source = shipped.TINY_MODEL_PATH if bundled else source
        if quant is not None and (adapter_specs or adapter_root is not None):
            raise ValueError(f"quant={quant!r} with adapters: adapter voices are served on unquantised weights only")
        if offload is not None and compile:
            raise ValueError(f"offload={offload} with compile=True: the compiled step cannot copy experts in")
        model, processor = load_model_and_processor(source, device, "auto", quant=quant, offload=offload)
        voices = VoiceStore(voices_dir, processor)
        voices.listing()  # logs every stored voice that can no longer be read, once, at start
        if bundled:
            register_bundled_voices(voices)
        for spec in voice_specs:
            name, references = reference_file_voice(spec)
            voices.add(name, references, replace=True)
        adapters = None
        if named_adapters or adapter_root is not None:
            adapters = AdapterRegistry(model, max_adapters, adapter_rank, os.path.join(voices_dir, ".adapters"), adapter_root)
            for reason in adapters.register_stored():  # kept on disk: a later start may load it again
                logger.warning("adapters: skipping the stored adapter %s", reason)
            for name, path in named_adapters:
                if name in adapters:  # never drop an upload for a flag: the user says which goes
                    raise ValueError(f"--adapter {name}={path}: an uploaded adapter {name!r} is stored in "
                                     f"{adapters.storage}; delete it (DELETE /v1/audio/voices/{name}) or use another name")
                adapters.register(name, path)
        metrics = ServerMetrics()
        cache = PrefixCache() if prefix_cache else None
        metrics.prefix_cache = cache
        engine = Drama3Engine(model, max_batch=max_batch, max_queue=max_queue, prefix_cache=cache,
                              on_finish=lambda handle, outcome: metrics.count(outcome), threads=threads,
                              compile_config=default_compile_config() if compile else None, adapters=adapters,
                              prefill_chunk=prefill_chunk if prefill_chunk is not None else default_prefill_chunk(device),
                              **({} if prefill_share is None else {"prefill_share": prefill_share}))
        if start_engine:
            engine.start()
        name = "drama3-tiny" if bundled else os.path.basename(os.path.normpath(source))
        default_voice = shipped.DEFAULT_VOICE if bundled else None
        return cls(model, processor, voices, name, engine, metrics, default_voice, adapters=adapters)

    # ---- request -> job -----------------------------------------------------------------------

    def references_of(self, params: SpeechParams):
        """The references a request clones: its voice's, then its inline ones."""
        references = []
        voice = params.voice
        if voice is None and not params.references:
            voice = self.default_voice
        if voice is not None:
            if not self.has_voice(voice):
                raise ApiError(404, f"voice: no voice {voice!r}; registered: {self.voices.ids()}", "voice", "voice_not_found")
            if voice in self.voices:  # an adapter voice may come with reference clips, or speak without
                references += self.stored_references(voice, "voice")
        for index, item in enumerate(params.references):
            if isinstance(item, tuple):
                _, voice_id, speaker = item
                stored = self.stored_references(voice_id, f"references[{index}].audio")
                references += [Reference(r.transcript, r.audio, speaker) for r in stored]
                continue
            try:
                references.append(self.voices.encode(item, f"references[{index}]"))
            except ValueError as error:
                raise ApiError(400, str(error), f"references[{index}].audio") from None
        return references

    def stored_references(self, voice_id: str, param: str):
        """A stored voice's encoded references; ApiError 404 when it is gone, 500 when its folder is damaged."""
        try:
            return self.voices.references(voice_id)
        except KeyError:
            raise ApiError(404, f"{param}: no voice {voice_id!r}", param, "voice_not_found") from None
        except DamagedVoice as error:
            raise ApiError(409, f"{param}: {error}; delete it and create it again", param, "voice_damaged") from None

    def job(self, params: SpeechParams, timeout: float) -> SpeechJob:
        """Prompt rows, sampling settings and budget of a request (raises ApiError on bad input)."""
        references = self.references_of(params)
        try:
            lines = parse_text(params.input, "input")
            _check_speakers_have_voices(lines, references)
            if params.instructions:
                lines = tuple(line if line.note else dataclasses.replace(line, note=params.instructions) for line in lines)
                lines = tuple(line.checked("instructions") for line in lines)
            script = Script(lines=lines, references=tuple(references))
            rows = self.processor(script)
        except ValueError as error:
            param = "instructions" if "instructions" in str(error) else "input"
            raise ApiError(400, str(error), param) from None
        prefix = (params.voice or self.default_voice) if not params.references else None
        job = self.job_of_rows(rows, timeout, params.options, prefix=prefix)
        return dataclasses.replace(job, adapter=self.adapter_of(params.voice))

    def voice_of(self, params: SpeechParams) -> str | None:
        """The voice a checked request speaks with: its own, else the default voice when it gives no
        references (None: its references alone)."""
        return params.voice if params.voice is not None or params.references else self.default_voice

    def has_voice(self, voice_id) -> bool:
        """A stored voice (reference clips) or a fine-tuned voice (an adapter)."""
        return voice_id in self.voices or self.adapter_of(voice_id) is not None

    def adapter_of(self, voice_id) -> str | None:
        """The adapter a voice speaks with, or None (a voice of reference clips, or no voice)."""
        return voice_id if self.adapters is not None and voice_id is not None and voice_id in self.adapters else None

    def voice_listing(self) -> list[dict]:
        """The stored voices and the adapter voices, by id; an adapter voice has "adapter": true."""
        voices = {voice["id"]: voice for voice in self.voices.listing()}
        for name in self.adapters.names() if self.adapters is not None else []:
            voices[name] = {**voices.get(name, {"id": name, "name": name}), "adapter": True}
        return [voices[key] for key in sorted(voices)]

    def job_of_rows(self, rows, timeout: float | None, options: dict, preset: str | None = None,
                    prefix=None) -> SpeechJob:
        """The engine job of one request's prompt rows (the processor's output for a `Script`, its
        layout included: the engine reads the turn to speak from `speak_span`) and its request
        options (name -> checked value, `decoding.options`): sampling as the model's generation
        config says, then `preset`, then the options; `prefix` keys the voice-prefix cache (any
        hashable, or None; the engine keys an adapter's prefixes apart)."""
        settings, max_new_tokens, _ = resolve_settings(getattr(self.model, "generation_config", None), preset, None, options)
        seed = options.get("seed")
        device = self.model.device
        boundaries = rows.get("boundaries_left")
        return SpeechJob(
            rows["input_ids"].to(device), rows["audio_codes"].to(device), settings,
            seed=seed, max_new_tokens=max_new_tokens, timeout=timeout, prefix=prefix,
            boundaries_left=None if boundaries is None else int(boundaries[0]), speak_span=rows.get("speak_span"),
        )

    def check_stream_options(self, params: TextStreamParams) -> None:
        """Refuse a text stream whose options, merged with the model's generation config, the decode
        would refuse (ApiError 400), before its stream starts."""
        try:
            resolve_settings(getattr(self.model, "generation_config", None), None, None, params.options)
        except ValueError as error:
            raise ApiError(400, str(error)) from None

    def text_stream(self, params: TextStreamParams, references, seed: int, pieces, stop, preset: str | None = None,
                    first_window: int | None = None):
        """`model.stream_text` for a checked `start` message: its items (audio chunks, events);
        sampling as the model's generation config says, then `preset`, then the message's fields;
        a fine-tuned voice speaks with its adapter. `first_window`: frames of each turn's first
        audio chunk (None: the codec's schedule)."""
        options = {name: value for name, value in params.options.items() if name != "seed"}  # the stream's own seed
        stream = self.model.stream_text(
            pieces, processor=self.processor, references=tuple(references), codec=self.processor.codec, seed=seed,
            preset=preset, max_bytes=params.chunk_bytes or CHUNK_BYTES, stop=stop, first_window=first_window, **options,
        )
        adapter = self.adapter_of(params.voice)
        return stream if adapter is None else adapter_stream(self.adapters, adapter, stream)

    def waveform(self, codes: torch.Tensor) -> np.ndarray:
        """A take's codes [frames, num_codebooks] -> its waveform (offline decode)."""
        codec = self.processor.codec
        if codes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        audio = self.codec_work(decode_audio, codec, codes[None].to(codec.device), torch.tensor([codes.shape[0]]))[0]
        return audio.detach().cpu().float().numpy()

    def codec_work(self, work, *args):
        """`work(*args)` at the service's codec thread count (`codec_threads`)."""
        with torch_threads(self.codec_threads):
            return work(*args)


def adapter_stream(adapters, name: str, stream):
    """`stream`'s items, each made with adapter `name` routed in the thread that asks for it (the
    thread's routing is set only while an item is made); the adapter is held from the first item
    until the stream ends."""
    lease = adapters.acquire(name)
    try:
        index = torch.tensor([lease.slot], device=adapters.model.device)
        while True:
            with routed(index):
                try:
                    item = next(stream)
                except StopIteration:
                    return
            yield item
    finally:
        lease.release()


def _check_speakers_have_voices(lines, references) -> None:
    """Every speaker of the input needs a voice; the error says how to give one over HTTP."""
    known = sorted({reference.speaker for reference in references})
    for index, line in enumerate(lines):
        if known and line.speaker not in known:
            raise ApiError(
                400, f"input: line {index} is spoken by speaker {line.speaker}, who has no voice (the request's voices "
                f"are speakers {known}); add one: \"references\": [{{\"audio\": a voice id or base64 audio, "
                f"\"text\": its transcript, \"speaker\": {line.speaker}}}]", "input",
            )


def chunk_samples(chunks) -> list[np.ndarray]:
    """The waveforms [samples] of streamed `AudioChunk`s as float32 arrays, empty ones left out."""
    samples = (chunk.audio.detach().cpu().float().numpy() for chunk in chunks)
    return [audio for audio in samples if audio.size]


def driven_events(engine: Drama3Engine, handle):
    """A request's events (as `handle.events()`), the caller stepping an engine that has no
    scheduler thread until the request ends."""
    while True:
        while handle.queue.empty():
            engine.step()
        event = handle.queue.get()
        yield event
        if not isinstance(event, FramesEvent):
            return


def default_prefill_chunk(device: str) -> int:
    """Rows of prompt prefilled per scheduler step when none is asked: 512 on a GPU, where a chunk
    costs a few decode steps; 128 on a CPU, where prefill is compute-bound and 512 rows cost many
    (drama3-tiny, the attack mix: a running stream's worst gap 6.5 s at 512, 1.6 s at 128, with the
    long prompts' time about the same)."""
    return 512 if str(device).startswith("cuda") else 128


def serve_in_background(source, voices_dir, on_failure=None, **load_kwargs):
    """(get_service, thread): the service loads in a thread; `get_service()` is None until it is
    ready. A failed load calls `on_failure(message)` (one line naming what failed), which stops the
    server; without one the message is printed and the main thread interrupted."""
    holder: dict = {}

    def load():
        try:
            holder["service"] = SpeechService.load(source, voices_dir, **load_kwargs)
        except Exception as error:  # the server cannot serve without its model: say why and stop
            message = f"could not load: {error}".replace("\n", " ")
            if on_failure is not None:
                on_failure(message)
                return
            print(f"drama3 serve: {message}", file=sys.stderr)
            _thread.interrupt_main()

    thread = threading.Thread(target=load, name="drama3-load", daemon=True)
    thread.start()
    return (lambda: holder.get("service")), thread

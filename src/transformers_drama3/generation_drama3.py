"""generate() and stream(): argument resolution, regeneration, and the mixin the model inherits.

One `generate()` call runs one prefill of the prompt rows, then one decode step per frame (the
step is `decoding.step`; the run over it `decoding.loop.DecodeRun`):

    main token   <- lm_head restricted to the semantic band + eos, drawn by the main-token sampler
                    (with repetition-aware sampling, RAS; `decoding.sampler`)
    codes 1..9   <- the tower, run once per frame, each code drawn by the codebook sampler
    next row     <- [main, c0..c9] fed back through partial codebook fusion

until every item has drawn eos or used its frame budget (`decoding.budget`). The eos frame is
dropped, and so is a `<|semantic:0|>` frame right before eos (it decodes to a click after the
trailing silence).

Line-by-line prompts (lines separated by `<|audio_separator|>` in the last user turn, see
docs/prompt_layouts.md) add `<|audio_separator|>` to the main candidates, once per line boundary
the prompt has left: drawing it makes no frame and draws no code, the separator goes back in as a
text row (zero codes), exactly where the training rows put their supervised separators, and the
frame index of the boundary is reported (`line_boundaries`), so the take splits per line.

`cache_implementation` and `compile_config` only decide how the one step runs: eagerly on a cache
of the run's own length (the default), or compiled (`torch.compile(fullgraph=True)`, CUDA graphs)
on a cache of a power-of-two length class (`cache_implementation="static"`, compiled by default on
CUDA).

Place among the modules: the model (`modeling_drama3`) imports this module and inherits
`generate`/`stream` from `Drama3GenerationMixin`; this module imports nothing from the model and
drives it through `decoding`. Long texts and scenes, which need the processor, are spoken by
`long_form`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import GenerationConfig, GenerationMixin

from .codec.take_streaming import AudioChunk, ClickFilter, WaveformStreamer, decode_audio, put_chunk
from .decoding.alignment import CONFIG_KEY as ALIGNMENT_KEY
from .decoding.alignment import AlignmentMasks, resolve_alignment, turn_token_ids
from .decoding.budget import detect_anomalies, overlong_factor
from .decoding.loop import DecodeRun, FrameStep, TakeCollector
from .decoding.request import PREFILL_GRAPHS_KEY, DecodeRequest, make_sampler, resolve_decoding, resolve_request, resolve_separator_id
from .decoding.sampler import SEED_STRIDE, Drama3Sampler, SamplingSettings, item_seeds, resolve_settings
from .decoding.takes import Drama3GenerationOutput, split_lines  # noqa: F401  (split_lines: importable from here, as before)
from .decoding.threads import check_threads, resolve_threads, torch_threads


# ----------------------------------------------------------------------------- generate()


_OWN_ARGUMENTS = (
    "seed", "preset", "codec", "expected_seconds", "regenerate_on_anomaly", "audio_separator_token_id", "threads",
)


def prepare_prompt(model, input_ids, audio_codes, attention_mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check and shape a prompt: input_ids [batch, rows] (or [rows]), audio_codes [batch, rows,
    num_codebooks] (zeros when None), attention_mask [batch, rows] (ones when None, left padding only)."""
    if input_ids is None:
        raise ValueError("generate() needs input_ids: the prompt rows (processor output or [batch, rows] ids)")
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
        audio_codes = None if audio_codes is None else torch.as_tensor(audio_codes)[None]
        attention_mask = None if attention_mask is None else torch.as_tensor(attention_mask)[None]
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}; expected integer [batch, rows]")
    batch, rows = input_ids.shape
    if rows < 2:
        raise ValueError(f"input_ids has {rows} row(s); a prompt needs at least 2")
    _check_range(input_ids, "input_ids", model.config.text_config.vocab_size, "the text vocabulary")
    codebooks = model.config.num_codebooks
    if audio_codes is None:
        audio_codes = input_ids.new_zeros(batch, rows, codebooks)
    audio_codes = torch.as_tensor(audio_codes)
    if tuple(audio_codes.shape) != (batch, rows, codebooks):
        raise ValueError(
            f"audio_codes has shape {tuple(audio_codes.shape)}; expected [batch, rows, num_codebooks] = "
            f"{(batch, rows, codebooks)} to match input_ids"
        )
    _check_range(audio_codes, "audio_codes", model.config.codebook_size, "the codebook size")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = torch.as_tensor(attention_mask)
    if tuple(attention_mask.shape) != (batch, rows):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(batch, rows)}")
    if not bool(attention_mask[:, -1].bool().all()):
        raise ValueError("attention_mask: the last row of every prompt must be real; pad prompts on the left")
    real_rows = attention_mask.bool().sum(dim=1)
    if bool((real_rows < 2).any()):
        item = int((real_rows < 2).nonzero()[0])
        raise ValueError(f"attention_mask: prompt {item} has {int(real_rows[item])} real row(s); a prompt needs at least 2")
    device = model.device
    return input_ids.long().to(device), audio_codes.long().to(device), attention_mask.long().to(device)


def _check_range(values: torch.Tensor, name: str, size: int, what: str) -> None:
    """Ids index embedding tables: refuse what would be clamped or raise a bare IndexError."""
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"{name} has dtype {values.dtype}; expected integer ids")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= size):
        raise ValueError(
            f"{name} holds values in [{int(values.min())}, {int(values.max())}]; expected [0, {size}) ({what})"
        )


def _split_kwargs(kwargs: dict) -> dict:
    """Generation parameters among `kwargs`; any other name is an error (it would be ignored)."""
    known = {key for key in vars(GenerationConfig()) if not key.startswith("_")} | {"repetition_aware", ALIGNMENT_KEY, PREFILL_GRAPHS_KEY}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"generate() got unknown arguments {unknown}; it takes the prompt (input_ids, audio_codes, "
            f"attention_mask), GenerationConfig fields and {list(_OWN_ARGUMENTS)}"
        )
    return kwargs


@dataclass
class _Call:
    """One generate() or stream() call, checked and resolved: the prompt (input_ids, audio_codes,
    attention_mask), its request, and whether the caller asked for a `Drama3GenerationOutput`."""

    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    request: DecodeRequest
    return_dict: bool


def _set_up(
    model, input_ids, audio_codes, attention_mask, generation_config, preset, expected_seconds,
    audio_separator_token_id, layout: dict, kwargs: dict, streaming: str | None,
) -> _Call:
    """Read the arguments of a call in one place: the sampling settings, the prompt, its frame
    budgets and line separators (`layout`: the processor's `speak_span` / `boundaries_left`).
    `streaming` names what streams ("streamer", "stream()"), or None: streaming needs a batch of
    1 prompt."""
    overrides = _split_kwargs(kwargs)
    settings, max_new_tokens, return_dict = resolve_settings(
        getattr(model, "generation_config", None), preset, generation_config, overrides
    )
    prompt = prepare_prompt(model, input_ids, audio_codes, attention_mask)
    if streaming is not None and prompt[0].shape[0] != 1:
        raise ValueError(f"{streaming}: streaming needs a batch of 1 prompt; got {prompt[0].shape[0]}")
    separator_id = resolve_separator_id(model, generation_config, audio_separator_token_id)
    request = resolve_request(
        model, settings, prompt[0], prompt[2], max_new_tokens, expected_seconds, separator_id, layout
    )
    request = replace(request, decoding=resolve_decoding(model, generation_config, overrides))
    alignment = resolve_alignment(model, [generation_config, overrides])
    if alignment is not None:
        rows = turn_token_ids(prompt[0].cpu(), prompt[2].cpu(), model.config.eos_token_id, layout.get("speak_span"))
        tracker = AlignmentMasks(alignment, rows, model.config.codebook_size, request.expected_frames.tolist(), prompt[0].device)
        request = replace(request, alignment=tracker)
    return _Call(prompt, request, return_dict)


def check_codec_matches(config, codec, location: str = "codec") -> None:
    """The codec's frames are the ones the model counts: its frame rate must be the config's
    (`sampling_rate / frame_size`), else budgets, durations and streaming windows are off."""
    if codec is None:
        return
    if not math.isclose(float(codec.frame_rate), float(config.frame_rate), rel_tol=1e-6):
        raise ValueError(
            f"{location}: {float(codec.frame_rate):.4f} frames/s, but the model's config says {float(config.frame_rate):.4f} "
            f"(sampling_rate {config.sampling_rate} / frame_size {config.frame_size}); use the codec the model was trained with"
        )


def _start(model, input_ids, audio_codes, attention_mask, request: DecodeRequest, seed) -> tuple[Drama3Sampler, Iterator[FrameStep]]:
    """The sampler of one decode run and its steps (not started until iterated)."""
    sampler = make_sampler(model, request, input_ids, attention_mask, seed)
    # a fresh tracker per run: every run starts at the beginning of its text
    aligner = None if request.alignment is None else request.alignment.select(range(input_ids.shape[0]))

    def steps():
        run = DecodeRun.prefilled(
            model, input_ids, audio_codes, attention_mask, sampler, request.budgets, request.separators, aligner,
            request.decoding.compile_config, request.decoding.prefill_graphs,
        )
        yield from run.steps_ahead()  # the run is dropped at its end: its last row may be fed past it

    return sampler, steps()


def _run(model, input_ids, audio_codes, attention_mask, request: DecodeRequest, seed, codec, streamer=None):
    """One decode run over a batch: the takes, their waveforms and what the guards found."""
    started = time.perf_counter()
    sampler, steps = _start(model, input_ids, audio_codes, attention_mask, request, seed)
    collector = TakeCollector(input_ids.shape[0])
    waveform_streamer = clicks = None
    if streamer is not None:
        waveform_streamer, clicks = WaveformStreamer(codec, started), ClickFilter()
    for step in steps:
        collector.add(step)
        if waveform_streamer is not None:
            for chunk in waveform_streamer.step(clicks, step):
                put_chunk(streamer, chunk)
    if waveform_streamer is not None:
        for chunk in waveform_streamer.finish():
            if chunk.codes.numel():
                put_chunk(streamer, chunk)
        streamer.end()
    codes, lengths, clicks_dropped = collector.finish(model.config.num_codebooks, input_ids.device)
    audio = decode_audio(codec, codes, lengths) if codec is not None else None
    overlong = overlong_factor(model)
    anomalies = [
        detect_anomalies(
            int(lengths[item]),
            collector.finish_reasons[item],
            float(request.expected_frames[item]),
            int(request.guard_budgets[item]),
            None if audio is None else audio[item],
            None if codec is None else codec.sampling_rate,
            overlong,
        )
        for item in range(input_ids.shape[0])
    ]
    return Drama3GenerationOutput(
        audio_codes=codes,
        sequences=codes,
        lengths=lengths,
        audio=audio,
        finish_reasons=collector.finish_reasons,
        budgets=request.budgets,
        expected_frames=request.expected_frames,
        anomalies=anomalies,
        regenerations=[],
        ras_replacements=sampler.ras_replacements,
        clicks_dropped=clicks_dropped,
        time_to_first_audio=None if waveform_streamer is None else waveform_streamer.time_to_first_audio,
        line_boundaries=collector.line_boundaries,
    )


def _regenerate(model, prompt, request: DecodeRequest, seed, codec, output: Drama3GenerationOutput, attempts: int):
    """Regenerate the anomalous takes of `output` up to `attempts` times; a new take replaces the old
    one when it has no more anomalies. Every attempt is recorded in `output.regenerations`."""
    input_ids, audio_codes, attention_mask = prompt
    batch = input_ids.shape[0]
    seeds = None if seed is None else item_seeds(seed, batch)
    takes = [
        [output.audio_codes[item, : int(output.lengths[item])], None if output.audio is None else output.audio[item]]
        for item in range(batch)
    ]
    for attempt in range(1, attempts + 1):
        items = [item for item in range(batch) if output.anomalies[item]]
        if not items:
            break
        index = torch.tensor(items, device=input_ids.device)
        sub_request = request.select(index)
        # attempt n draws with seed + n * SEED_STRIDE: retries differ from the first take yet reproduce
        sub_seed = None if seeds is None else [seeds[item] + attempt * SEED_STRIDE for item in items]
        retry = _run(model, input_ids[index], audio_codes[index], attention_mask[index], sub_request, sub_seed, codec)
        for position, item in enumerate(items):
            kept = len(retry.anomalies[position]) <= len(output.anomalies[item])
            output.regenerations.append(
                {
                    "item": item,
                    "attempt": attempt,
                    "anomalies": list(output.anomalies[item]),
                    "new_anomalies": list(retry.anomalies[position]),
                    "kept": kept,
                }
            )
            if kept:
                length = int(retry.lengths[position])
                takes[item] = [retry.audio_codes[position, :length], None if retry.audio is None else retry.audio[position]]
                output.anomalies[item] = retry.anomalies[position]
                output.finish_reasons[item] = retry.finish_reasons[position]
                output.clicks_dropped[item] = retry.clicks_dropped[position]
                output.ras_replacements[item] = retry.ras_replacements[position]
                output.line_boundaries[item] = retry.line_boundaries[position]
    lengths = torch.tensor([take[0].shape[0] for take in takes], dtype=torch.long, device=input_ids.device)
    codes = input_ids.new_zeros(batch, int(lengths.max()) if batch else 0, model.config.num_codebooks)
    for item, (take_codes, _) in enumerate(takes):
        codes[item, : take_codes.shape[0]] = take_codes
    output.audio_codes = output.sequences = codes
    output.lengths = lengths
    if output.audio is not None:
        output.audio = [take[1] for take in takes]
    return output


@torch.no_grad()
def generate(
    model,
    input_ids=None,
    audio_codes=None,
    attention_mask=None,
    generation_config: GenerationConfig | None = None,
    streamer=None,
    *,
    seed: int | Sequence[int] | None = None,
    preset: str | SamplingSettings | None = None,
    codec=None,
    expected_seconds: float | Sequence[float] | None = None,
    regenerate_on_anomaly: int = 0,
    audio_separator_token_id: int | None = None,
    speak_span: torch.Tensor | None = None,
    boundaries_left: torch.Tensor | None = None,
    threads: int | str | None = "auto",
    **kwargs,
):
    """Speak: prompt rows in, takes out (see the module docstring for the loop and the sampler).

    Args:
        input_ids, audio_codes, attention_mask: the prompt, as the processor returns it (a
            `BatchFeature`, unpacked) or raw rows: `[batch, rows]`, `[batch, rows, num_codebooks]`,
            `[batch, rows]` (left padding).
        generation_config: a `GenerationConfig`; its `do_sample`, `temperature`, `top_p`, `top_k`,
            `repetition_aware` (RAS on the main token, default True), `max_new_tokens` (frames)
            and `return_dict_in_generate` are read.
        streamer: an object with `put(value)` and `end()` (a transformers `BaseStreamer`); batch 1.
            It receives waveform chunks `[samples]` when `codec` is given, else frames
            `[1, frames, num_codebooks]`, as soon as they are final.
        seed: an int (item b uses seed + b) or one per item; each item draws its own
            random numbers (`decoding.counter_noise`), so a batch reproduces each prompt alone.
            None: random keys from torch's global generator (`torch.manual_seed` repeats a run).
        preset: "serving" (the default settings) or "paper-eval" (0.7 / 0.7 / 30), or settings.
        codec: a `Drama3CodecModel`; the output then carries waveforms.
        expected_seconds: expected duration of each take; default from the text of the turn to
            speak at the model's speaking rate (`text_tokens_per_second`: the generation config's
            `text_tokens_per_second`, else `TOKENS_PER_SECOND`). The frame budget is 2.5x this, at
            most 4096 frames.
        regenerate_on_anomaly: regenerate anomalous takes up to this many times (paper §9).
        audio_separator_token_id: the id of `<|audio_separator|>` (`processor.audio_separator_token_id`;
            default: `audio_separator_token_id` of the generation config or model config). With it,
            a line-by-line prompt (lines separated by the separator in its last user turn) may draw
            the separator between lines, once per line boundary it has left; each one is reported
            in `line_boundaries`. Other prompts never draw it.
        speak_span, boundaries_left: the layout's metadata on the processor's rows (`[batch, 2]`
            rows of the text of the turn to speak, `[batch]` line boundaries still to draw); rows
            given without them are read from their token ids.
        threads: CPU threads to decode with: "auto" (default) picks them from the model's size and
            the idle cores (`threads.decode_threads`), an int is used as given, None leaves torch's
            count alone; torch's count is restored afterwards. "auto" leaves a model on CUDA alone.
        **kwargs: GenerationConfig fields (e.g. `temperature=0.7`, `max_new_tokens=500`).
            Every call decodes with the one step (`decoding.step`) on a preallocated cache the
            prefill writes into. `cache_implementation="static"` gives that cache a power-of-two
            length class and compiles the step (`torch.compile(fullgraph=True)`, CUDA graphs) by
            default on CUDA, or wherever `compile_config=CompileConfig(...)` is given, unless
            `disable_compile=True`: the same frames and the same seeded draws as the eager step.
            The first call compiles; so does the first call whose batch size or length class
            differs (the default config leaves dynamic shapes to torch: those sizes then stay
            symbolic and later calls run that graph; batch 1 keeps its own). `prefill_graphs=True` (a
            compiled run) left-pads the prompt to its power-of-two length bucket and prefills it
            through a compiled prefill too (one graph per bucket, batch size and length class).

    Returns:
        `Drama3GenerationOutput` with `return_dict_in_generate=True`; otherwise the waveforms
        (a list, when `codec` is given) or `audio_codes` `[batch, frames, num_codebooks]`.
    """
    if isinstance(regenerate_on_anomaly, bool) or not isinstance(regenerate_on_anomaly, int) or regenerate_on_anomaly < 0:
        raise ValueError(f"regenerate_on_anomaly={regenerate_on_anomaly!r}; expected 0 (off) or a positive number of attempts")
    if streamer is not None and regenerate_on_anomaly:
        raise ValueError("regenerate_on_anomaly cannot be combined with a streamer: streamed audio cannot be taken back")
    check_threads(threads)
    check_codec_matches(model.config, codec)
    call = _set_up(
        model, input_ids, audio_codes, attention_mask, generation_config, preset, expected_seconds,
        audio_separator_token_id, {"speak_span": speak_span, "boundaries_left": boundaries_left}, kwargs,
        None if streamer is None else "streamer",
    )
    with torch_threads(resolve_threads(model, threads)):
        output = _run(model, *call.prompt, call.request, seed, codec, streamer)
        if regenerate_on_anomaly:
            output = _regenerate(model, call.prompt, call.request, seed, codec, output, regenerate_on_anomaly)
    if call.return_dict:
        return output
    return output.audio if codec is not None else output.audio_codes


@torch.no_grad()
def stream(
    model,
    input_ids=None,
    audio_codes=None,
    attention_mask=None,
    generation_config: GenerationConfig | None = None,
    *,
    seed: int | Sequence[int] | None = None,
    preset: str | SamplingSettings | None = None,
    codec=None,
    expected_seconds: float | None = None,
    windows: Iterator[int] | None = None,
    audio_separator_token_id: int | None = None,
    speak_span: torch.Tensor | None = None,
    boundaries_left: torch.Tensor | None = None,
    threads: int | str | None = "auto",
    **kwargs,
) -> Iterator[AudioChunk]:
    """Speak one prompt and yield `AudioChunk`s as frames are produced.

    With a codec each chunk holds the waveform of a window of frames (10, 10, 12, 32, then 64;
    `windows` overrides the schedule); the chunks concatenate to the offline waveform of the same
    codes. Without a codec each chunk holds one frame's codes. The last chunk has `is_last`.
    `chunk.elapsed` of the first chunk is the time to first audio. A line-by-line prompt reports
    its line boundaries in `chunk.line_boundaries`; together they are `generate`'s. Arguments as
    in `generate`.
    """
    check_threads(threads)
    check_codec_matches(model.config, codec)
    call = _set_up(
        model, input_ids, audio_codes, attention_mask, generation_config, preset, expected_seconds,
        audio_separator_token_id, {"speak_span": speak_span, "boundaries_left": boundaries_left}, kwargs,
        "stream()",
    )
    started = time.perf_counter()
    _, steps = _start(model, *call.prompt, call.request, seed)
    waveform_streamer = WaveformStreamer(codec, started, windows)
    clicks = ClickFilter()
    # torch keeps the count per thread: the caller's code between chunks runs with it too.
    with torch_threads(resolve_threads(model, threads)):
        for step in steps:
            yield from waveform_streamer.step(clicks, step)
        yield from waveform_streamer.finish()


# ----------------------------------------------------------------------------- the model's methods


class Drama3GenerationMixin(GenerationMixin):
    """`generate` and `stream` as methods of `Drama3ForSpeechGeneration`, which inherits them (as
    transformers' CSM model inherits its generation mixin): modeling imports generation, never the
    reverse. The model provides `prefill`, `extend`, `sample_acoustic_codes`, `speech_logits`,
    `speech_token_ids` and `is_semantic`."""

    def generate(self, input_ids=None, audio_codes=None, attention_mask=None, generation_config=None, streamer=None, **kwargs):
        """Speak: one prefill, then one decode step per frame. See `generation_drama3.generate`."""
        return generate(self, input_ids, audio_codes, attention_mask, generation_config, streamer, **kwargs)

    def stream(self, input_ids=None, audio_codes=None, attention_mask=None, generation_config=None, **kwargs):
        """Speak one prompt, yielding audio chunks as frames are produced. See `generation_drama3.stream`."""
        return stream(self, input_ids, audio_codes, attention_mask, generation_config, **kwargs)

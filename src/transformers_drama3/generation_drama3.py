"""generate() and stream(): the decode run, regeneration, and the mixin the model inherits.

One `generate()` call runs one prefill of the prompt rows, then one decode step per frame (the
step is `decoding.step`; the run over it `decoding.loop.DecodeRun`):

    main token   <- lm_head restricted to the semantic band + eos, drawn by the main-token sampler
                    (with repetition-aware sampling, RAS; `decoding.sampler`)
    codes 1..9   <- the tower, run once per frame, each code drawn by the codebook sampler
    next row     <- [main, c0..c9] fed back through partial codebook fusion

until every item has drawn eos or used its frame budget (`decoding.budget`). The eos frame is
dropped from the take, and so is a `<|semantic:0|>` frame right before eos (it decodes to a click
after the trailing silence).

What it returns (GenerationMixin's contract, with the speech in it):

    generate(**inputs)                                  the takes: audio_codes [batch, frames, num_codebooks]
    generate(**inputs, codec=processor.codec)           the takes' waveforms (a list of [samples])
    generate(**inputs, return_dict_in_generate=True)    a `Drama3GenerationOutput` (transformers'
        `GenerateDecoderOnlyOutput`): `sequences` [batch, prompt_rows + steps, 1 + num_codebooks],
        the prompt rows and one row `[main_id, c0..c9]` per step; `scores` / `logits` /
        `hidden_states` per step when asked (`output_scores`, `output_logits`,
        `output_hidden_states`); and the takes beside them (`audio_codes`, `lengths`, `audio`).

Without the dict, generate() returns the takes rather than `sequences`: token ids alone make no
sound, and a take is what a speech caller uses (as transformers' CSM returns its generated codes,
or its audio with `output_audio=True`). `processor.decode(output.sequences)` decodes the rows to
the same audio, which is how transformers' text-to-speech pipeline reads them.
`num_return_sequences` speaks each prompt several times, each take reproducible from its seed
(`generation.call`). Every other GenerationMixin option either works or is refused by name before
any work (`generation.arguments`).

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
`runtime.long_form`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence

import torch
from transformers import GenerationConfig, GenerationMixin

from .codec.take_audio import AudioChunk, ClickFilter, WaveformStreamer, decode_audio, put_chunk
from .decoding.budget import detect_anomalies, overlong_factor
from .decoding.loop import DecodeRun, FrameStep, TakeCollector
from .decoding.request import make_sampler
from .decoding.sampler import SEED_STRIDE, Drama3Sampler, SamplingSettings
from .decoding.takes import Drama3GenerationOutput, split_lines  # noqa: F401  (split_lines: importable from here, as before)
from .decoding.threads import check_threads, resolve_threads, torch_threads
from .generation.call import GenerationCall, prepare_prompt, set_up_call, split_kwargs
from .generation.outputs import RecordingSampler, RowCollector, backbone_states, in_vocabulary, warped

__all__ = ["Drama3GenerationMixin", "Drama3GenerationOutput", "check_codec_matches", "generate", "prepare_prompt",
           "split_lines", "stream"]


def _split_kwargs(kwargs: dict, caller: str = "stream_text()") -> dict:
    """`generation.call.split_kwargs` for the callers that return no generation output."""
    return split_kwargs(kwargs, caller)


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


# ----------------------------------------------------------------------------- a decode run


def _start(model, call: GenerationCall, sampler_class=Drama3Sampler) -> tuple[Drama3Sampler, Iterator[FrameStep]]:
    """The sampler of one decode run and its steps (not started until iterated)."""
    input_ids, audio_codes, attention_mask = call.prompt
    request = call.request
    sampler = make_sampler(model, request, sampler_class)
    # a fresh tracker per run: every run starts at the beginning of its text
    aligner = None if request.alignment is None else request.alignment.select(range(input_ids.shape[0]))

    def steps():
        run = DecodeRun.prefilled(
            model, input_ids, audio_codes, attention_mask, sampler, request.budgets, request.separators, aligner,
            request.decoding.compile_config, request.decoding.prefill_graphs, call.inputs_embeds,
        )
        yield from run.steps_ahead()  # the run is dropped at its end: its last row may be fed past it

    return sampler, steps()


def _run(model, call: GenerationCall, codec, streamer=None) -> Drama3GenerationOutput:
    """One decode run over a batch: the rows it drew, the takes, their waveforms, what the guards
    found, and the per-step outputs `call.outputs` asks for."""
    started = time.perf_counter()
    input_ids, audio_codes, _ = call.prompt
    request, outputs = call.request, call.outputs
    recording = outputs.scores or outputs.logits
    sampler, steps = _start(model, call, RecordingSampler if recording else Drama3Sampler)
    collector, rows = TakeCollector(call.batch), RowCollector(call.batch, call.pad_id)
    waveform_streamer = clicks = None
    if streamer is not None:
        waveform_streamer, clicks = WaveformStreamer(codec, started), ClickFilter()
    with backbone_states(model.backbone, outputs.hidden_states) as states:
        for step in steps:
            collector.add(step)
            rows.add(step)
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
        for item in range(call.batch)
    ]
    new_rows = rows.finish(model.config.num_codebooks).to(input_ids.device)
    prompt_rows = torch.cat((input_ids[..., None], audio_codes), dim=-1)
    output = Drama3GenerationOutput(
        sequences=torch.cat((prompt_rows, new_rows), dim=1),
        audio_codes=codes,
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
    if recording:
        _add_scores(model, sampler, new_rows.shape[1], outputs, output)
    if outputs.hidden_states:
        output.hidden_states = tuple(states[: new_rows.shape[1]])
    return output


def _add_scores(model, sampler: RecordingSampler, steps: int, outputs, output: Drama3GenerationOutput) -> None:
    """The per-step logits the sampler recorded (the first `steps`: a run may draw past its end),
    as `scores` / `logits` over the vocabulary and `codebook_scores` / `codebook_logits`."""
    settings = sampler.settings
    main = torch.stack(sampler.main_logits[:steps])  # [steps, batch, candidates]
    heads = torch.stack(sampler.head_logits[:steps])  # [steps, batch, num_codebooks - 1, codebook_size]
    vocabulary = model.get_output_embeddings().weight.shape[0]
    if outputs.logits:
        output.logits = tuple(in_vocabulary(main, sampler.candidate_ids, vocabulary).unbind(0))
        output.codebook_logits = tuple(heads.unbind(0))
    if outputs.scores:
        scores = warped(main, settings, settings.top_k, keep_crossing=True)
        output.scores = tuple(in_vocabulary(scores, sampler.candidate_ids, vocabulary).unbind(0))
        output.codebook_scores = tuple(warped(heads, settings, settings.codebook_top_k, keep_crossing=False).unbind(0))


def _regenerate(model, call: GenerationCall, codec, output: Drama3GenerationOutput, attempts: int):
    """Regenerate the anomalous takes of `output` up to `attempts` times; a new take replaces the old
    one (its rows in `sequences` too) when it has no more anomalies. Every attempt is recorded in
    `output.regenerations`."""
    batch, prompt_rows = call.batch, call.prompt[0].shape[1]
    seeds = call.request.seeds
    takes = [
        [output.audio_codes[item, : int(output.lengths[item])], None if output.audio is None else output.audio[item]]
        for item in range(batch)
    ]
    drawn = list(output.sequences[:, prompt_rows:])  # per item [steps, 1 + num_codebooks]
    for attempt in range(1, attempts + 1):
        items = [item for item in range(batch) if output.anomalies[item]]
        if not items:
            break
        index = torch.tensor(items, device=call.prompt[0].device)
        # attempt n draws with seed + n * SEED_STRIDE: retries differ from the first take yet reproduce
        sub_seed = None if seeds is None else [seeds[item] + attempt * SEED_STRIDE for item in items]
        retry = _run(model, call.select(index).reseeded(sub_seed), codec)
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
                drawn[item] = retry.sequences[position, prompt_rows:]
                output.anomalies[item] = retry.anomalies[position]
                output.finish_reasons[item] = retry.finish_reasons[position]
                output.clicks_dropped[item] = retry.clicks_dropped[position]
                output.ras_replacements[item] = retry.ras_replacements[position]
                output.line_boundaries[item] = retry.line_boundaries[position]
    lengths = torch.tensor([take[0].shape[0] for take in takes], dtype=torch.long, device=call.prompt[0].device)
    codes = call.prompt[0].new_zeros(batch, int(lengths.max()) if batch else 0, model.config.num_codebooks)
    for item, (take_codes, _) in enumerate(takes):
        codes[item, : take_codes.shape[0]] = take_codes
    output.audio_codes = codes
    output.lengths = lengths
    output.sequences = torch.cat((output.sequences[:, :prompt_rows], _padded_rows(drawn, call.pad_id)), dim=1)
    if output.audio is not None:
        output.audio = [take[1] for take in takes]
    return output


def _padded_rows(rows: list[torch.Tensor], pad_id: int) -> torch.Tensor:
    """Per item rows [steps_i, 1 + num_codebooks] -> [batch, max steps, 1 + num_codebooks], the
    shorter ones continued with `[pad_id, zeros]` (what an ended item draws)."""
    steps = max(item.shape[0] for item in rows)
    padded = rows[0].new_zeros(len(rows), steps, rows[0].shape[-1])
    padded[..., 0] = pad_id
    for index, item in enumerate(rows):
        padded[index, : item.shape[0]] = item
    return padded


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
    position_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    **kwargs,
):
    """Speak: prompt rows in, takes out (see the module docstring for the loop, the sampler and
    what is returned).

    Args:
        input_ids, audio_codes, attention_mask: the prompt, as the processor returns it (a
            `BatchFeature`, unpacked) or raw rows: `[batch, rows]`, `[batch, rows, num_codebooks]`,
            `[batch, rows]` (left padding).
        generation_config: a `GenerationConfig`; its `do_sample`, `temperature`, `top_p`, `top_k`,
            `repetition_aware` (RAS on the main token, default True), `max_new_tokens` (frames),
            the output fields below and the cache fields are read; any field that would not work
            (beams, assisted decoding, logits processors, stop strings, ...) is refused by name
            (`generation.arguments`), as it is from the model's own generation config.
        streamer: an object with `put(value)` and `end()` (a transformers `BaseStreamer`); batch 1.
            It receives waveform chunks `[samples]` when `codec` is given, else frames
            `[1, frames, num_codebooks]`, as soon as they are final.
        seed: an int (item b uses seed + b) or one per item (per returned take with
            `num_return_sequences`); each item draws its own random numbers
            (`decoding.counter_noise`), so a batch reproduces each prompt alone. None: random keys
            from torch's global generator (`torch.manual_seed` repeats a run).
        preset: "serving" (the default settings) or "paper-eval" (0.7 / 0.7 / 30), or settings.
        codec: a `Drama3CodecModel` (`processor.codec`): the takes' waveforms are returned (in
            `audio` of the dict), decoded by it.
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
        position_ids: `[batch, rows]` positions of the prompt rows; taken where they are those
            generate() gives them (each real row's count of real rows before it, as forward's
            default), refused otherwise (`generation.call.check_position_ids`).
        inputs_embeds: `[batch, rows, hidden_size]` the backbone's input for the prompt rows
            instead of their embeddings (`model.embed_rows`); needs the rows too (input_ids,
            audio_codes), which the tower, RAS and the frame budget read.
        **kwargs: GenerationConfig fields (e.g. `temperature=0.7`, `max_new_tokens=500`).
            `return_dict_in_generate=True` returns a `Drama3GenerationOutput`; with it
            `output_scores`, `output_logits` and `output_hidden_states` add the per-step outputs
            (hidden states need the eager step), and `num_return_sequences=N` speaks every prompt
            N times (take i of prompt p is item p*N + i, drawn with seed + p*N + i).
            `pad_token_id` fills `sequences` after an item has ended (default: eos).
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
        `Drama3GenerationOutput` with `return_dict_in_generate=True`; otherwise the takes: their
        waveforms (a list of [samples], when `codec` is given) or `audio_codes`
        `[batch, frames, num_codebooks]` (0 after each take's length).
    """
    if isinstance(regenerate_on_anomaly, bool) or not isinstance(regenerate_on_anomaly, int) or regenerate_on_anomaly < 0:
        raise ValueError(f"regenerate_on_anomaly={regenerate_on_anomaly!r}; expected 0 (off) or a positive number of attempts")
    if streamer is not None and regenerate_on_anomaly:
        raise ValueError("regenerate_on_anomaly cannot be combined with a streamer: streamed audio cannot be taken back")
    check_threads(threads)
    check_codec_matches(model.config, codec)
    call = set_up_call(
        model, input_ids, audio_codes, attention_mask, generation_config, seed, preset, expected_seconds,
        audio_separator_token_id, {"speak_span": speak_span, "boundaries_left": boundaries_left}, kwargs,
        None if streamer is None else "streamer", "generate()", position_ids, inputs_embeds,
    )
    if regenerate_on_anomaly and call.outputs.per_step:
        raise ValueError("regenerate_on_anomaly cannot be combined with output_scores, output_logits or "
                         "output_hidden_states: a regenerated take's steps are not the batch's")
    with torch_threads(resolve_threads(model, threads)):
        output = _run(model, call, codec, streamer)
        if regenerate_on_anomaly:
            output = _regenerate(model, call, codec, output, regenerate_on_anomaly)
    if call.outputs.return_dict:
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
    call = set_up_call(
        model, input_ids, audio_codes, attention_mask, generation_config, seed, preset, expected_seconds,
        audio_separator_token_id, {"speak_span": speak_span, "boundaries_left": boundaries_left}, kwargs,
        "stream()", "stream()",
    )
    started = time.perf_counter()
    _, steps = _start(model, call)
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

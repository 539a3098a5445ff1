"""Long texts and scenes: a script of any length spoken chunk by chunk (`generate_long_form`), or
a scene spoken one speaker turn at a time (`generate_scene_turns`).

This module sits above the processor: it cuts the script with `Drama3Processor.chunk`, builds each
chunk's prompt with the processor (the first and the previous take as history,
`prompting.long_text_history`), and speaks each prompt with `generation_drama3.generate`. The takes'
codes are concatenated, and every frame goes once through one `WaveformStreamer` (the codec's
streaming decoder, its state running on over the chunk seams): a caller's streamer gets its
chunks as frames are made, and the same chunks make `LongFormOutput.audio`, so a streamed call
decodes each frame once and writes the same waveform as a call without a streamer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..codec.take_audio import WaveformStreamer, put_chunk
from ..generation_drama3 import check_codec_matches, generate
from ..processing_drama3 import Drama3Processor
from ..prompting import Script, Take, long_text_history, parse_text, speaker_turns

LONG_FORM_FRAMES_PER_CHUNK = 1024
"""Default cap on the frames of one chunk of a long text (as the MLX port)."""


SCENE_MODES = ("joint", "turns")
"""How `generate_long_form` speaks a script with several speakers. "joint": each chunk in one take,
every speaker in it (the published model's way). "turns": one single-speaker cloning request per
speaker turn (`generate_scene_turns`), for a model trained only on single-speaker rows, such as
drama3-tiny. A model's generation config may choose the default (`scene_mode`)."""


@dataclass
class SpeakerTurn:
    """One speaker turn of a scene spoken turn by turn: frames [start, end) of the scene's codes.

    speaker: the script's speaker; request: the single-speaker request it was spoken as (speaker 0);
    finish_reasons / anomalies: per chunk of the turn."""

    speaker: int
    request: Script
    start: int
    end: int
    finish_reasons: list[str]
    anomalies: list[list[str]]


@dataclass
class LongFormOutput:
    """A long text spoken chunk by chunk.

    audio: [samples] the whole waveform (when the processor has a codec): the chunks of the call's
    one `WaveformStreamer`, the same with a streamer or without;
    audio_codes: [frames, num_codebooks] every chunk's take, in order; chunk_lengths: frames per
    chunk; chunks: the chunk scripts; finish_reasons / anomalies: per chunk; time_to_first_audio:
    seconds to the first streamed chunk (with a streamer); turns: the speaker turns, when the
    script was spoken turn by turn (else None).
    """

    audio: torch.Tensor | None
    audio_codes: torch.Tensor
    chunk_lengths: list[int]
    chunks: list
    finish_reasons: list[str]
    anomalies: list[list[str]]
    sampling_rate: int | None = None
    time_to_first_audio: float | None = None
    turns: list[SpeakerTurn] | None = None


class _LongFormWaveform:
    """The one waveform stream of a long-form call: every frame of every take goes once through
    one `WaveformStreamer`, whose decoder state runs on over the chunk seams. Its chunks go to the
    caller's streamer (`target`, when there is one) and make the call's waveform (`audio`).

    With a target the frames come live, as `generate` makes them (this is `generate`'s streamer:
    frames in, no end per chunk); without one each take's codes are pushed once it is spoken.
    The window schedule depends only on how many frames came before, so both ways decode the
    same windows and give the same waveform."""

    def __init__(self, codec, target):
        self.codec, self.target = codec, target
        decodes = codec is not None or target is not None
        self.waveform_streamer = WaveformStreamer(codec, time.perf_counter()) if decodes else None
        self.pieces: list[torch.Tensor] = []

    @property
    def live(self) -> bool:
        """Frames come from `generate` as they are made (a caller streams), not once per take."""
        return self.target is not None

    def put(self, frames: torch.Tensor) -> None:
        """frames: [1, frames, num_codebooks], final."""
        self._push(frames[0])

    def end(self) -> None:
        """A chunk ended; the stream goes on."""

    def take_spoken(self, codes: torch.Tensor) -> None:
        """A take [frames, num_codebooks] is spoken: push it, unless its frames came live."""
        if not self.live and self.waveform_streamer is not None:
            self._push(codes)

    def close(self) -> torch.Tensor | None:
        """End the stream (the target's `end()`); the whole waveform [samples], without a codec None."""
        if self.waveform_streamer is not None:
            for chunk in self.waveform_streamer.finish():
                if chunk.codes.numel() or (chunk.audio is not None and chunk.audio.numel()):
                    self._hand_on(chunk)
        if self.target is not None:
            self.target.end()
        if self.codec is None:
            return None
        if not self.pieces:
            return torch.zeros(0, device=self.codec.device)
        return torch.cat(self.pieces)

    @property
    def time_to_first_audio(self) -> float | None:
        """Seconds to the first streamed chunk; None when the call does not stream."""
        return self.waveform_streamer.time_to_first_audio if self.live else None

    def _push(self, frames: torch.Tensor) -> None:
        for chunk in self.waveform_streamer.push(list(frames)):
            self._hand_on(chunk)

    def _hand_on(self, chunk) -> None:
        if chunk.audio is not None:
            self.pieces.append(chunk.audio)
        if self.target is not None:
            put_chunk(self.target, chunk)


class _FrameProgress:
    """The progress bar of a long-form call: the frames made so far and the seconds of audio they
    hold, advanced as each frame is final (`generate` hands it the frames as their streamer, and it
    hands them on to the waveform when the call streams audio). A call that regenerates anomalous
    takes cannot stream, so its bar advances once per chunk instead."""

    def __init__(self, frame_rate: float, waveform: _LongFormWaveform, enabled: bool):
        self.frame_rate, self.waveform, self.enabled = frame_rate, waveform, enabled
        self.relay = waveform if waveform.live else None
        self.bar = tqdm(desc="speaking", unit="frame", disable=not enabled)
        self.where = ""

    def streamer(self, regenerating: bool):
        """What `generate` streams to: this bar (frames as they come), else just the relay."""
        return self if self.enabled and not regenerating else self.relay

    def start(self, where: str) -> None:
        """Say which part of the script is being spoken ("chunk 2/5", "turn 1/3")."""
        self.where = where
        self._show()

    def advance(self, frames: int) -> None:
        self.bar.update(frames)
        self._show()

    def take_spoken(self, codes: torch.Tensor, regenerating: bool) -> None:
        """A chunk's take [frames, num_codebooks] is final: to the waveform (once), to the bar
        when its frames did not come one by one."""
        if regenerating:
            self.advance(codes.shape[0])
        self.waveform.take_spoken(codes)

    def put(self, frames: torch.Tensor) -> None:
        """frames: [1, frames, num_codebooks], final."""
        self.advance(frames.shape[1])
        if self.relay is not None:
            self.relay.put(frames)

    def end(self) -> None:
        """A chunk ended (`generate` ends its stream); the relay's stream goes on."""
        if self.relay is not None:
            self.relay.end()

    def close(self) -> None:
        self.bar.close()

    def _show(self) -> None:
        self.bar.set_postfix_str(f"{self.bar.n / self.frame_rate:.1f} s of audio, {self.where}", refresh=False)


@dataclass
class _SpokenChunks:
    """The takes of chunks spoken in order: codes [frames, num_codebooks] and the outcome of each."""

    chunks: list = field(default_factory=list)
    codes: list[torch.Tensor] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    anomalies: list[list[str]] = field(default_factory=list)

    def extend(self, other: _SpokenChunks) -> None:
        self.chunks += other.chunks
        self.codes += other.codes
        self.finish_reasons += other.finish_reasons
        self.anomalies += other.anomalies

    @property
    def frames(self) -> int:
        return sum(codes.shape[0] for codes in self.codes)


def _long_form_script(processor: Drama3Processor, text, references, strict_speakers: bool = True):
    """The script of a long-form call: a `Script`, or raw text read with `references`."""
    if isinstance(text, str):
        parse_text(text, "text")  # refused here with its location; one chunk is spoken as given
        return Script(text, tuple(references), strict_speakers=strict_speakers)
    script = processor.as_request(text, tuple(references), "text")
    if type(script) is not Script:
        raise ValueError(f"text: long-form generation takes raw text or a Script; got {type(script).__name__}")
    return script


def _speak_chunks(model, processor: Drama3Processor, script, seed, progress: _FrameProgress, max_new_tokens,
                  generate_kwargs, where: str = "") -> _SpokenChunks:
    """Speak `script` chunk by chunk; chunk k draws with seed + k and has the history of the first
    and the previous take (after the script's own history). `where` prefixes the bar's "chunk k/n"."""
    spoken = _SpokenChunks(chunks=processor.chunk(script))
    regenerating = bool(generate_kwargs.get("regenerate_on_anomaly"))
    takes = []
    for index, chunk in enumerate(spoken.chunks):
        progress.start(f"{where}chunk {index + 1}/{len(spoken.chunks)}")
        request = chunk.with_history((*script.history, *long_text_history(takes)))
        inputs = processor(request)
        output = generate(
            model,
            inputs["input_ids"],
            inputs["audio_codes"],
            inputs["attention_mask"],
            speak_span=inputs["speak_span"],
            boundaries_left=inputs["boundaries_left"],
            streamer=progress.streamer(regenerating),
            seed=None if seed is None else seed + index,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            **generate_kwargs,
        )
        codes = output.audio_codes[0, : int(output.lengths[0])]
        progress.take_spoken(codes, regenerating)
        spoken.codes.append(codes)
        spoken.finish_reasons.append(output.finish_reasons[0])
        spoken.anomalies.append(output.anomalies[0])
        if codes.shape[0]:
            takes.append(Take(lines=chunk.lines, audio=codes.T.cpu()))
    return spoken


def _long_form_output(model, codec, spoken: _SpokenChunks, progress: _FrameProgress, turns=None) -> LongFormOutput:
    """Every take's codes in order and their waveform (each frame decoded once, by the call's one
    `WaveformStreamer`); ends the stream and the bar."""
    progress.close()
    audio = progress.waveform.close()
    if spoken.codes:
        audio_codes = torch.cat(spoken.codes)
    else:
        audio_codes = torch.zeros(0, model.config.num_codebooks, dtype=torch.long)
    return LongFormOutput(
        audio=audio,
        audio_codes=audio_codes,
        chunk_lengths=[codes.shape[0] for codes in spoken.codes],
        chunks=spoken.chunks,
        finish_reasons=spoken.finish_reasons,
        anomalies=spoken.anomalies,
        sampling_rate=None if codec is None else codec.sampling_rate,
        time_to_first_audio=progress.waveform.time_to_first_audio,
        turns=turns,
    )


def resolve_scene_mode(model, scene: str | None) -> str:
    """`scene`, else the `scene_mode` of the model's generation config, else "joint"."""
    if scene is not None:
        location, mode = "scene", scene
    else:
        configured = getattr(getattr(model, "generation_config", None), "scene_mode", None)
        location, mode = "generation_config.scene_mode", configured or "joint"
    if mode not in SCENE_MODES:
        raise ValueError(f"{location}={mode!r}; expected one of {list(SCENE_MODES)}")
    return mode


@torch.no_grad()
def generate_long_form(
    model,
    processor: Drama3Processor,
    text,
    *,
    references=None,
    reference_audio=None,
    reference_text=None,
    reference_speaker=None,
    seed: int | None = None,
    streamer=None,
    progress: bool = True,
    max_new_tokens: int = LONG_FORM_FRAMES_PER_CHUNK,
    scene: str | None = None,
    **generate_kwargs,
) -> LongFormOutput:
    """Speak a script of any length, one chunk at a time, keeping the voice across chunks.

    The processor cuts the script into chunks (~300 UTF-8 bytes, at most 3 speakers each; spec
    §4). Chunk k is generated with the history of the first chunk's take and the previous
    chunk's take (`prompting.long_text_history`), after any history the script already has, so
    the voice carries over. A tqdm bar (`progress`) counts the frames as they are made, with the
    seconds of audio they hold and the chunk being spoken.

    Args:
        text: raw text (speaker tags allowed) or a `prompting.Script`.
        references / reference_audio + reference_text (+ reference_speaker, 0 by default): voice
            references for raw text.
        seed: chunk k draws with seed + k.
        streamer: receives waveform chunks across the whole script (batch 1), `end()` once.
        max_new_tokens: frames cap of one chunk (also bounded by its own budget).
        scene: "joint" (as above) or "turns" (`generate_scene_turns`: one single-speaker request per
            speaker turn); default: the model generation config's `scene_mode`, else "joint".
        **generate_kwargs: passed to `generate` (sampling settings, preset, ...).
    """
    arguments = dict(
        references=references,
        reference_audio=reference_audio,
        reference_text=reference_text,
        reference_speaker=reference_speaker,
        seed=seed,
        streamer=streamer,
        progress=progress,
        max_new_tokens=max_new_tokens,
    )
    check_codec_matches(model.config, processor.codec, "processor.codec")
    if resolve_scene_mode(model, scene) == "turns":
        return generate_scene_turns(model, processor, text, **arguments, **generate_kwargs)
    if references is None:
        references = processor.references_from(reference_audio, reference_text, reference_speaker)
    script = _long_form_script(processor, text, references)
    bar = _FrameProgress(processor.frame_rate, _LongFormWaveform(processor.codec, streamer), progress)
    spoken = _speak_chunks(model, processor, script, seed, bar, max_new_tokens, generate_kwargs)
    return _long_form_output(model, processor.codec, spoken, bar)


@torch.no_grad()
def generate_scene_turns(
    model,
    processor: Drama3Processor,
    text,
    *,
    references=None,
    reference_audio=None,
    reference_text=None,
    reference_speaker=None,
    seed: int | None = None,
    streamer=None,
    progress: bool = True,
    max_new_tokens: int = LONG_FORM_FRAMES_PER_CHUNK,
    **generate_kwargs,
) -> LongFormOutput:
    """Speak a scene one speaker turn at a time, each turn as a single-speaker cloning request.

    The script is cut into speaker turns (maximal runs of consecutive lines of one speaker;
    `prompting.speaker_turns`): each is spoken from that speaker's references alone, renumbered to
    speaker 0, as a long text of its own (it chunks when long; its chunks share history, turns do
    not). The turns' codes are concatenated in order and each frame is decoded once, by one
    `WaveformStreamer` across every turn. Chunk k of the whole scene
    draws with seed + k, so a one-speaker script gives `generate_long_form`'s joint take. The tqdm
    bar counts frames, as in `generate_long_form`, and names the turn. Arguments as in `generate_long_form`; every speaker needs a reference.

    Returns:
        `LongFormOutput` whose `turns` say where each speaker turn starts and ends (frames), who
        spoke it, and how its chunks finished; the per-chunk fields cover every turn's chunks.
    """
    if references is None:
        references = processor.references_from(reference_audio, reference_text, reference_speaker)
    # speaker_turns names a speaker without a reference in this mode's words
    script = _long_form_script(processor, text, references, strict_speakers=False)
    requests = speaker_turns(script)
    bar = _FrameProgress(processor.frame_rate, _LongFormWaveform(processor.codec, streamer), progress)
    spoken, turns = _SpokenChunks(), []
    for index, (speaker, request) in enumerate(requests):
        turn_seed = None if seed is None else seed + len(spoken.chunks)
        part = _speak_chunks(model, processor, request, turn_seed, bar, max_new_tokens, generate_kwargs,
                             where=f"turn {index + 1}/{len(requests)}, ")
        start = spoken.frames
        spoken.extend(part)
        turns.append(SpeakerTurn(speaker, request, start, spoken.frames, part.finish_reasons, part.anomalies))
    return _long_form_output(model, processor.codec, spoken, bar, turns)

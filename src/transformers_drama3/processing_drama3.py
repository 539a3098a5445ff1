"""Drama3Processor: scripts and conversations -> model rows; generated codes -> waveforms."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import soundfile
import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer, BatchFeature
from transformers.utils import logging

from .codec import Drama3CodecConfig, Drama3CodecModel, Drama3MelCodecConfig, Drama3PhoneCodecConfig
from .feature_extraction_drama3 import SAMPLING_RATE, Drama3FeatureExtractor, seconds_over
from .output_files import atomic_output
from .decoding.budget import MIN_SPEECH_FRACTION, speech_shortfall
from .integrations import ProcessorMixinWithOwnParts, hub_keywords, optional_file
from .prompting import (
    AUDIO_SEPARATOR,
    IM_END,
    CHUNK_BYTES,
    CHUNK_SPEAKERS,
    CODEBOOK_SIZE,
    IGNORE_INDEX,
    MAX_REFERENCE_SECONDS,
    NUM_CODEBOOKS,
    Clip,
    Frames,
    LayoutContext,
    PromptRows,
    Reference,
    Request,
    Script,
    Special,
    StreamingScript,
    Infill,
    Take,
    TokenIds,
    as_clip,
    assemble_infill,
    check_codes,
    check_speaker,
    encode_layout,
    parse_rows,
    parse_text,
    part_text,
    semantic_token,
    with_speaker_tag,
)
from .prompting.bare_rows import spoken_frames
from .prompting.phonemes import text_frontend as phoneme_front_end

SAMPLES_PER_FRAME = 2048
AUDIO_FORMATS = {".wav": "WAV", ".flac": "FLAC"}

logger = logging.get_logger(__name__)


class Drama3Processor(ProcessorMixinWithOwnParts):
    r"""The Drama 3 processor: the ChatML tokenizer, the audio feature extractor and the S2 codec.

    Calling it turns scripts (see `transformers_drama3.prompting`), raw text, or lists of them into
    a left-padded batch of model rows:

    - `input_ids` [batch, rows] long: the main token of each row; an audio row carries
      `<|semantic:c0|>` (= semantic_start + c0).
    - `audio_codes` [batch, rows, num_codebooks] long: the frame's codes c0..c9 on audio rows,
      zeros on text rows and padding.
    - `attention_mask` [batch, rows] long: 1 on real rows, 0 on (left) padding.
    - `labels` [batch, rows] long, when any request carries target audio (or `return_labels=True`):
      ALIGNED with the input rows, `labels[b, t] = input_ids[b, t]` where row t is the model's own
      output and -100 elsewhere. The model shifts by one (row t is trained to predict row t + 1);
      the acoustic targets are the `audio_codes` of the supervised semantic rows. Supervised rows
      are the target turn's audio frames, its learned `<|audio_separator|>` tokens and its closing
      `<|im_end|>` — never references, never history takes, never `<|voice|>` or padding. In the
      streaming layout every assistant turn is the model's own output and is supervised.

    Audio (references, history takes, targets, infilling sources) may be given as codes
    `[num_codebooks, frames]`; a codec is needed only for waveforms and files, and for decoding.
    Waveforms, files, URLs and base64 pass through `feature_extractor` (read, down-mix, resample, check)
    before the codec encodes them.

    Args:
        tokenizer: a tokenizer with every Drama 3 special token (the published `tokenizer.json`, or
            `tokenizer_build.build_drama3_tokenizer()` for tests).
        feature_extractor: a `Drama3FeatureExtractor`; None builds one at the codec's rate (or at
            `sampling_rate` without a codec). `save_pretrained` writes it (`preprocessor_config.json`
            and inside `processor_config.json`); folders saved without one load with the default.
        codec: a `Drama3CodecModel` (or another codec registered with `AutoConfig` and `AutoModel`), or
            None (codes-only use). Not a ProcessorMixin attribute (those must be tokenizers or
            feature extractors): `save_pretrained` writes it to `codec/` and `from_pretrained` reads
            it back.
        chat_template: kept for `ProcessorMixin`; `apply_chat_template` does not render Jinja,
            because audio rows cannot be written as a string token for token.
        codebook_size: size of the semantic band (4096).
        num_codebooks, frame_rate: used when there is no codec (the codec's own values win otherwise).
        sampling_rate: the feature extractor's rate when none is given and there is no codec (read
            from `processor_config.json` files written before the feature extractor existed).
        max_reference_seconds: references longer than this are refused.
        short_reference_seconds: references shorter than this are taken with a warning: from them
            the model may lose the voice or stop after a word or two (drama3-tiny records where its
            cloning was measured to break down); None (the default) warns about none. Saved in
            `processor_config.json` when set.
        min_reference_fraction: references shorter than this fraction of their transcript's
            expected duration are refused (cut, or the wrong transcript); 0 turns the check off.
        chunk_bytes, chunk_speakers: the long-text chunking limits of `chunk`.
        text_frontend: how spoken text is read (`prompting.phonemes`): None reads it as text (the
            published model); a phoneme entry reads its words as espeak-ng phonemes. Taken from the
            tokenizer's config when not given (its vocabulary is made for it); saved in
            `processor_config.json` when set.
    """

    def __init__(
        self,
        tokenizer,
        feature_extractor: Drama3FeatureExtractor | None = None,
        codec=None,
        chat_template: str | None = None,
        codebook_size: int = CODEBOOK_SIZE,
        num_codebooks: int = NUM_CODEBOOKS,
        sampling_rate: int | None = None,
        frame_rate: float = SAMPLING_RATE / SAMPLES_PER_FRAME,
        max_reference_seconds: float = MAX_REFERENCE_SECONDS,
        min_reference_fraction: float = MIN_SPEECH_FRACTION,
        chunk_bytes: int = CHUNK_BYTES,
        chunk_speakers: int = CHUNK_SPEAKERS,
        text_frontend: dict | None = None,
        short_reference_seconds: float | None = None,
    ):
        text_frontend = _checked_frontend(tokenizer, text_frontend)
        if feature_extractor is None:
            feature_extractor = Drama3FeatureExtractor(sampling_rate=sampling_rate or SAMPLING_RATE)
        elif sampling_rate is not None and int(sampling_rate) != feature_extractor.sampling_rate:
            raise ValueError(
                f"sampling_rate={sampling_rate} disagrees with the feature extractor's "
                f"{feature_extractor.sampling_rate}; give one of them"
            )
        super().__init__(tokenizer, feature_extractor, chat_template=chat_template)
        self.codec = codec
        self.codebook_size = codebook_size
        self.num_codebooks = num_codebooks
        self.frame_rate = frame_rate
        self.max_reference_seconds = max_reference_seconds
        if short_reference_seconds is not None and not short_reference_seconds > 0:
            raise ValueError(f"short_reference_seconds must be a positive number of seconds or None, got {short_reference_seconds}")
        self.short_reference_seconds = short_reference_seconds
        self.min_reference_fraction = min_reference_fraction
        self.chunk_bytes = chunk_bytes
        self.chunk_speakers = chunk_speakers
        self.token_ids = TokenIds.from_tokenizer(tokenizer, codebook_size)
        self.text_frontend = text_frontend
        self.front_end = phoneme_front_end(text_frontend)
        if text_frontend is not None and not self.token_ids.phonemes:
            raise ValueError(
                f"text_frontend={text_frontend} reads phonemes, but the tokenizer has no phoneme tokens "
                f"(<|ph:...|>); build it with tokenizer_build.build_drama3_tokenizer(phoneme_symbols=...)"
            )
        if codec is not None:
            self._adopt_codec_sizes(codec)

    _CONFIG_KEYS = (
        "codebook_size",
        "num_codebooks",
        "frame_rate",
        "max_reference_seconds",
        "min_reference_fraction",
        "chunk_bytes",
        "chunk_speakers",
    )

    @property
    def audio_separator_token_id(self) -> int | None:
        """The id of `<|audio_separator|>`, for `generate(audio_separator_token_id=...)` on
        line-by-line rows; None when the tokenizer lacks the token."""
        return self.token_ids.special.get(AUDIO_SEPARATOR)

    @property
    def sampling_rate(self) -> int:
        """The rate of every waveform in and out: the feature extractor's (= the codec's)."""
        return self.feature_extractor.sampling_rate

    def _adopt_codec_sizes(self, codec) -> None:
        """The codec is the truth about audio: its rate, frame rate and codebooks win."""
        self.num_codebooks = int(codec.num_codebooks)
        self.feature_extractor.sampling_rate = int(codec.sampling_rate)
        self.frame_rate = float(codec.frame_rate)

    # ---- saving and loading -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        # ProcessorMixin would deep-copy every attribute, the codec's weights included.
        output = {key: getattr(self, key) for key in self._CONFIG_KEYS}
        if self.text_frontend is not None:  # absent otherwise: saved files as before
            output["text_frontend"] = self.text_frontend
        if self.short_reference_seconds is not None:
            output["short_reference_seconds"] = self.short_reference_seconds
        output["feature_extractor"] = self.feature_extractor.to_dict()
        output["processor_class"] = type(self).__name__
        return output

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tokenizer={type(self.tokenizer).__name__}, codec={type(self.codec).__name__}, {self.to_json_string()})"

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """Tokenizer files, processor_config.json (the feature extractor nested in it, as
        ProcessorMixin writes it), preprocessor_config.json (the feature extractor on its own, for
        `AutoFeatureExtractor` and older readers), and the codec in `codec/` when there is one."""
        files = super().save_pretrained(save_directory, push_to_hub=False, **kwargs)
        files += self.feature_extractor.save_pretrained(save_directory)
        if self.codec is not None:
            self.codec.save_pretrained(os.path.join(save_directory, "codec"))
        if push_to_hub:
            raise NotImplementedError("push the saved folder with huggingface_hub.upload_folder")
        return files

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, codec=None, load_codec: bool = True, **kwargs):
        """Load the tokenizer (and processor_config.json when present) and the codec.

        The codec comes from `codec` when given, else from the `codec/` subfolder (written by
        `save_pretrained`), else from the published `codec.pth` beside the tokenizer. With
        `load_codec=False` or when none is found, the processor works on codes only."""
        processor = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        if codec is None and load_codec:
            codec = _load_codec(pretrained_model_name_or_path, kwargs)
        if codec is not None:
            processor.codec = codec
            processor._adopt_codec_sizes(codec)
        return processor

    @classmethod
    def parts_from_pretrained(cls, pretrained_model_name_or_path, processor_dict: dict, subfolder: str = "", **kwargs) -> list:
        """[tokenizer, feature extractor] of a saved processor (`from_pretrained` calls this).

        The feature extractor comes from `processor_config.json` or `preprocessor_config.json`;
        folders without either (the published repo, processors saved before it existed) give None,
        and `__init__` builds the default at the codec's rate."""
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        config = processor_dict.get("feature_extractor")
        if config is None:
            hub = hub_keywords(kwargs)
            try:
                config, _ = Drama3FeatureExtractor.get_feature_extractor_dict(
                    pretrained_model_name_or_path, subfolder=subfolder, **hub
                )
            except OSError:
                return [tokenizer, None]
        kind = config.get("feature_extractor_type", Drama3FeatureExtractor.__name__)
        if kind != Drama3FeatureExtractor.__name__:
            raise ValueError(
                f"{pretrained_model_name_or_path}: the saved feature extractor is a {kind}; Drama3Processor "
                f"needs a {Drama3FeatureExtractor.__name__}"
            )
        return [tokenizer, Drama3FeatureExtractor.from_dict(config)]

    @property
    def model_input_names(self) -> list[str]:
        return ["input_ids", "audio_codes", "attention_mask"]

    # ---- audio in ----------------------------------------------------------------------------------

    @property
    def samples_per_frame(self) -> int:
        return int(round(self.sampling_rate / self.frame_rate))

    def load_waveform(self, clip: Clip, location: str, max_seconds: float | None = None) -> np.ndarray:
        """A clip given as a waveform or a file -> checked mono float32 samples at the codec's rate
        (see `Drama3FeatureExtractor.load`)."""
        audio = clip.path if clip.path is not None else clip.waveform
        return self.feature_extractor.load(audio, clip.sampling_rate, location, max_seconds)

    def encode_audio(self, samples: np.ndarray, location: str) -> torch.Tensor:
        """Mono samples at the codec rate -> codes [num_codebooks, frames] (long)."""
        if self.codec is None:
            raise ValueError(
                f"{location}: audio needs a codec to become codes; load the processor with a codec or "
                f"give codes [num_codebooks, frames] instead"
            )
        audio = torch.from_numpy(samples)[None]  # [1, samples]
        with torch.no_grad():
            encoded = self.codec.encode(audio, sampling_rate=self.sampling_rate)
        return encoded.audio_codes[0, :, : int(encoded.lengths[0])].to("cpu", torch.long)

    def given_codes(self, clip: Clip, location: str) -> torch.Tensor | None:
        """The codes a clip was given as, checked, or None for a waveform or a file: the one gate of
        codes input. Integer codes of any dtype (uint16/32/64 included) are taken as int64; float
        codes are refused, and so is a float "waveform" that is shaped and valued like codes
        (`[num_codebooks, frames]`, whole numbers beyond [-1, 1]): encoding it as audio would
        silently speak noise."""
        if clip.codes is not None:
            return check_codes(clip.codes, self.num_codebooks, self.codebook_size, location)
        waveform = clip.waveform
        if waveform is not None and getattr(waveform, "ndim", 0) == 2 and waveform.shape[0] == self.num_codebooks:
            values = torch.as_tensor(waveform).double()
            if values.numel() and bool((values == values.round()).all()) and float(values.abs().max()) > 1:
                raise ValueError(
                    f"{location}: a float array [{self.num_codebooks}, frames] of whole numbers looks like codes "
                    f"given as floats; give codes as an integer array (e.g. .long()), or a waveform in [-1, 1]"
                )
        return None

    def codes_of(self, clip: Clip, location: str, is_reference: bool = False) -> torch.Tensor:
        """Any clip -> checked codes [num_codebooks, frames]; references are held to the length cap,
        measured on their codes whatever they came as (`max_reference_frames`)."""
        codes = self.given_codes(clip, location)
        if codes is None:
            # the audio's own length first: a cheap refusal before encoding (a clip of at most
            # max_reference_seconds codes to at most max_reference_frames frames)
            samples = self.load_waveform(clip, location, self.max_reference_seconds if is_reference else None)
            codes = check_codes(self.encode_audio(samples, location), self.num_codebooks, self.codebook_size, location)
        if is_reference:
            self._check_reference_length(codes.shape[1], location)
            self._warn_if_short(codes.shape[1] / self.frame_rate, location)
        return codes

    @property
    def max_reference_frames(self) -> int:
        """The most frames a reference may have: those of `max_reference_seconds` of audio, the codec
        rounding a part frame up. The one measure of a reference's length: a clip stored as a
        voice is held to it as audio when it arrives and as codes at every later use."""
        return math.ceil(self.max_reference_seconds * self.frame_rate)

    def _check_reference_length(self, frames: int, location: str) -> None:
        if frames > self.max_reference_frames:
            seconds = seconds_over(frames / self.frame_rate, self.max_reference_seconds)
            raise ValueError(
                f"{location}: the reference is {seconds} s long ({frames} frames); references may be at most "
                f"{self.max_reference_seconds:g} s ({self.max_reference_frames} frames; cut a representative part)"
            )

    def _warn_if_short(self, seconds: float, location: str) -> None:
        if self.short_reference_seconds is not None and seconds < self.short_reference_seconds:
            logger.warning(
                f"{location}: the reference is {seconds:.1f} s long; this model clones reliably from references "
                f"of at least {self.short_reference_seconds:g} s, and from a shorter one it may lose the voice "
                f"or stop after a word or two (give a longer clip of the voice)"
            )

    def layout_context(self) -> LayoutContext:
        return LayoutContext(codes_of=self.codes_of, frame_rate=self.frame_rate)

    # ---- requests -> rows ------------------------------------------------------------------------------

    def references_from(
        self,
        reference_audio: Any = None,
        reference_text: str | Sequence[str] | None = None,
        reference_speaker: int | Sequence[int] | None = None,
        sampling_rate: int | None = None,
    ) -> tuple[Reference, ...]:
        """Parallel lists of reference audio and transcripts (and speakers, 0 by default) -> references."""
        if reference_audio is None and reference_text is None:
            return ()
        audios = list(reference_audio) if isinstance(reference_audio, (list, tuple)) else [reference_audio]
        texts = [reference_text] if isinstance(reference_text, str) else list(reference_text or [])
        if reference_audio is None or len(audios) != len(texts):
            raise ValueError(
                f"reference_audio/reference_text: {0 if reference_audio is None else len(audios)} reference "
                f"audios but {len(texts)} transcripts; every reference needs exactly one transcript"
            )
        if reference_speaker is None:
            speakers = [None] * len(audios)  # a transcript's own leading tag, else speaker 0
        elif isinstance(reference_speaker, (int, np.integer)):
            speakers = [reference_speaker] * len(audios)
        else:
            speakers = list(reference_speaker)
        if len(speakers) != len(audios):
            raise ValueError(f"reference_speaker: {len(speakers)} speakers for {len(audios)} references")
        return tuple(
            Reference(text, as_clip(audio, f"references[{index}].audio", sampling_rate), speaker)
            for index, (audio, text, speaker) in enumerate(zip(audios, texts, speakers))
        )

    def as_request(self, item: Any, references: Sequence[Reference], location: str) -> Request:
        if isinstance(item, (Script, Infill, StreamingScript)):
            if references:
                raise ValueError(f"{location}: give references inside the script, not beside it")
            return item
        if isinstance(item, str):
            parse_text(item, location)  # refused here with its location; the Script keeps it as given
            return Script(lines=item, references=references)
        raise ValueError(f"{location}: expected a str, Script, Infill or StreamingScript; got {type(item).__name__}")

    def rows(self, request: Request) -> PromptRows:
        """One request's rows (no padding)."""
        context = self.layout_context()
        transcripts = {id(reference.audio): reference.transcript for reference in getattr(request, "references", ())}
        if transcripts and self.min_reference_fraction > 0:
            context = LayoutContext(self._reference_checker(transcripts), self.frame_rate)
        return encode_layout(request.layout(context), self.tokenizer, self.token_ids, self.num_codebooks, self.front_end)

    def _reference_checker(self, transcripts: dict[int, str]):
        """`codes_of` that also refuses a reference far too short for its transcript (a 1 ms clip, a
        file cut to a tenth; see `min_reference_fraction`): a voice learnt from audio that is not
        those words. `transcripts`: id of each reference's clip -> its transcript."""

        def codes_of(clip: Clip, location: str, is_reference: bool = False) -> torch.Tensor:
            codes = self.codes_of(clip, location, is_reference)
            if is_reference and id(clip) in transcripts:
                self.check_reference_covers(codes, transcripts[id(clip)], location)
            return codes

        return codes_of

    def check_reference_covers(self, codes: torch.Tensor, transcript: str, location: str) -> None:
        """Refuse reference codes [num_codebooks, frames] far too short to be a recording of
        `transcript` (under `min_reference_fraction` of its expected duration; 0 turns this off)."""
        if self.min_reference_fraction <= 0:
            return
        problem = speech_shortfall(codes.shape[1] / self.frame_rate, transcript, self.min_reference_fraction)
        if problem is not None:
            raise ValueError(f"{location}: {problem}; give the whole recording of its transcript")

    def __call__(
        self,
        text: str | Request | Sequence[str | Request] | None = None,
        *,
        references: Sequence[Reference] | None = None,
        reference_audio: Any = None,
        reference_text: str | Sequence[str] | None = None,
        reference_speaker: int | Sequence[int] | None = None,
        sampling_rate: int | None = None,
        return_labels: bool | None = None,
        padding_side: str = "left",
        return_tensors: str | None = "pt",
        **kwargs,
    ) -> BatchFeature:
        """Rows for one request or a batch.

        Args:
            text: raw text (speaker tags `<|speaker:N|>` allowed), a `Script` / `LineByLineScript` /
                `Infill` / `StreamingScript`, or a list of them (a batch).
            references / reference_audio + reference_text (+ reference_speaker): voice references
                for raw-text items (scripts carry their own).
            sampling_rate: rate of waveforms given in reference_audio (the codec's when None).
            return_labels: force labels on or off (default: on when a request has target audio).
            padding_side: "left" (generation, default) or "right".
        """
        if kwargs:
            raise TypeError(f"Drama3Processor got unexpected arguments {sorted(kwargs)}")
        if return_tensors not in (None, "pt"):
            raise ValueError(f"return_tensors: only 'pt' is supported; got {return_tensors!r}")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side: 'left' or 'right'; got {padding_side!r}")
        if text is None:
            raise ValueError("text: nothing to speak")
        items = list(text) if isinstance(text, (list, tuple)) else [text]
        if not items:
            raise ValueError("text: the batch is empty")
        if references is not None and (reference_audio is not None or reference_text is not None):
            raise ValueError("give references or reference_audio/reference_text, not both")
        if references is None:
            references = self.references_from(reference_audio, reference_text, reference_speaker, sampling_rate)
        references = tuple(references)
        location = (lambda index: f"text[{index}]") if len(items) > 1 else (lambda index: "text")
        requests = [self.as_request(item, references, location(index)) for index, item in enumerate(items)]
        rows = [self.rows(request) for request in requests]
        if return_labels is None:
            return_labels = any(bool(r.supervised.any()) for r in rows)
        batch = self.pad(rows, return_labels=return_labels, padding_side=padding_side)
        batch.update(self.layout_metadata(rows, batch["input_ids"].shape[1], padding_side))
        return batch

    def layout_metadata(self, rows: Sequence[PromptRows], length: int, padding_side: str = "left") -> dict:
        """What the layout says about each prompt, in padded row coordinates, for `generate()`:

        - `speak_span` [batch, 2] long: [start, stop) rows of the text of the turn to speak (its
          length sets the frame budget);
        - `boundaries_left` [batch] long: line boundaries (`<|audio_separator|>`) still to draw.
        """
        spans = torch.zeros(len(rows), 2, dtype=torch.long)
        for index, row in enumerate(rows):
            offset = length - len(row) if padding_side == "left" else 0
            spans[index] = torch.tensor(row.speak_span) + offset
        boundaries = torch.tensor([row.boundaries_left for row in rows], dtype=torch.long)
        return {"speak_span": spans, "boundaries_left": boundaries}

    def pad(self, rows: Sequence[PromptRows], return_labels: bool = False, padding_side: str = "left") -> BatchFeature:
        """Stack prompts into a batch: pad id / zero codes / mask 0 / label -100 on the padding."""
        length = max(len(r) for r in rows)
        batch = len(rows)
        input_ids = torch.full((batch, length), self.token_ids.pad, dtype=torch.long)
        audio_codes = torch.zeros(batch, length, self.num_codebooks, dtype=torch.long)
        attention_mask = torch.zeros(batch, length, dtype=torch.long)
        labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
        for index, row in enumerate(rows):
            span = slice(length - len(row), length) if padding_side == "left" else slice(0, len(row))
            input_ids[index, span] = row.input_ids
            audio_codes[index, span] = row.audio_codes
            attention_mask[index, span] = 1
            labels[index, span] = row.labels
        data = {"input_ids": input_ids, "audio_codes": audio_codes, "attention_mask": attention_mask}
        if return_labels:
            data["labels"] = labels
        return BatchFeature(data=data, tensor_type="pt")

    def chunk(self, script: Script) -> list[Script]:
        """Long text -> one script per chunk (spec §4 limits of this processor)."""
        return script.chunks(self.chunk_bytes, self.chunk_speakers)

    def infill_codes(self, infill: Infill, middle: torch.Tensor) -> torch.Tensor:
        """The whole edited recording as codes [num_codebooks, frames]: prefix + middle + suffix.

        `middle` is the generated middle, [num_codebooks, frames] or [frames, num_codebooks]."""
        if middle.ndim == 2 and middle.shape[0] != self.num_codebooks and middle.shape[1] == self.num_codebooks:
            middle = middle.T
        middle = check_codes(middle, self.num_codebooks, self.codebook_size, "middle")
        prefix, suffix = infill.kept_codes(self.layout_context())
        return assemble_infill(prefix, middle, suffix)

    def parse(self, batch: BatchFeature | dict, index: int = 0) -> Request:
        """Rows of one batch item -> the request they encode, whatever its layout (padding removed;
        see `prompting.parse_rows`). The batch's labels, when it has them, tell an infilling
        target's frames from the kept prefix."""
        mask = batch["attention_mask"][index].bool()
        labels = batch.get("labels")
        supervised = None if labels is None else labels[index][mask] != IGNORE_INDEX
        return parse_rows(
            batch["input_ids"][index][mask], batch["audio_codes"][index][mask], self.tokenizer, self.token_ids, supervised
        )

    def render(self, request: Request) -> str:
        """The prompt as text, audio frames written as their `<|semantic:c0|>` tokens (for reading)."""
        out = []
        for segment in request.layout(self.layout_context()):
            if isinstance(segment, Frames):
                out.extend(semantic_token(int(code)) for code in segment.codes[0])
            else:
                out.extend(part_text(part) for part in segment.parts)
        return "".join(out)

    # ---- conversations ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: list[dict] | list[list[dict]],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        return_dict: bool = True,
        return_tensors: str | None = "pt",
        processor_kwargs: dict | None = None,
        **kwargs,
    ):
        """Conversations in the Hugging Face audio style -> the same rows as the script model.

        Messages, in order:
        - `{"role": "system", "content": [text, audio, text, audio, ...]}`: references; each audio
          item follows its transcript; speaker from the audio item's or the message's "speaker" (0).
        - `{"role": "<N>"}` (a speaker 0-15, CSM style): text + audio = a reference of speaker N;
          text only = a line of speaker N.
        - `{"role": "user"}`: text = lines (raw text, `<|speaker:N|>` tags allowed); text followed
          by audio = a reference (speaker from the item's or message's "speaker", 0 by default).
        - `{"role": "assistant"}`: one audio item, the take of the lines since the previous take.
          Takes before the last lines are history; a take that ends the conversation is the target
          (training rows with labels).
        Content is a string or a list of `{"type": "text", "text"}` / `{"type": "audio", "path" |
        "url" | "audio" (+ "sampling_rate") | "codes"}` items.

        Returns the `__call__` BatchFeature (tokenize=True, return_dict=True), the input ids
        alone (return_dict=False), or the prompt text with audio as semantic tokens (tokenize=False).
        """
        if chat_template is not None:
            raise ValueError("chat_template: Drama 3 prompts are built by the layout, not by a Jinja template")
        unknown = set(kwargs) - {"return_assistant_tokens_mask", "continue_final_message"}
        if unknown:
            raise TypeError(f"apply_chat_template got unexpected arguments {sorted(unknown)}")
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        conversations = conversation if batched else [conversation]
        scripts = [
            conversation_to_script(messages, f"conversation[{index}]" if batched else "conversation")
            for index, messages in enumerate(conversations)
        ]
        if not add_generation_prompt and any(script.target is None for script in scripts):
            raise ValueError(
                "add_generation_prompt=False: a Drama 3 prompt without target audio always ends with the "
                "voice turn <|im_start|>assistant\\n<|voice|>"
            )
        if not tokenize:
            texts = [self.render(script) for script in scripts]
            return texts if batched else texts[0]
        outputs = self(scripts, return_tensors=return_tensors, **(processor_kwargs or {}))
        return outputs if return_dict else outputs["input_ids"]

    # ---- codes out -------------------------------------------------------------------------------------

    def batch_decode(self, codes: torch.Tensor | Sequence[torch.Tensor], lengths: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Generated codes -> waveforms through the codec.

        Args:
            codes: [batch, frames, num_codebooks] (generate()'s takes, `audio_codes`), a list of
                [frames, num_codebooks] tensors of any lengths, or generate()'s `sequences`
                [batch, rows, 1 + num_codebooks] (rows `[main_id, c0..c9]`: each item's voice turn
                is decoded, `spoken_frames`; what transformers' text-to-speech pipeline hands over).
            lengths: frames of each item (default: all frames); not with `sequences`.

        Returns:
            A list of 1-D float32 waveforms at `sampling_rate`, each `frames * samples_per_frame` long.
        """
        if self.codec is None:
            raise ValueError("batch_decode needs a codec; load the processor with one")
        if isinstance(codes, torch.Tensor) and codes.ndim == 3 and codes.shape[-1] == self.num_codebooks + 1:
            if lengths is not None:
                raise ValueError("lengths: sequences (rows of 1 + num_codebooks values) end where their voice turn ends; "
                                 "give no lengths")
            codes = [self.spoken_frames(item) for item in codes]
        if isinstance(codes, torch.Tensor):
            if codes.ndim != 3 or codes.shape[-1] != self.num_codebooks:
                raise ValueError(f"codes: expected [batch, frames, {self.num_codebooks}]; got {tuple(codes.shape)}")
            items = list(codes)
        else:
            items = list(codes)
        if lengths is not None:
            if len(lengths) != len(items):
                raise ValueError(f"lengths: {len(lengths)} lengths for {len(items)} items")
            items = [item[: int(length)] for item, length in zip(items, lengths)]
        checked = [
            check_codes(item.T, self.num_codebooks, self.codebook_size, f"codes[{index}]") if len(item) else item.T
            for index, item in enumerate(items)
        ]
        frames = [item.shape[1] for item in checked]
        longest = max(frames)
        if longest == 0:
            return [torch.zeros(0) for _ in items]
        stacked = torch.zeros(len(items), self.num_codebooks, longest, dtype=torch.long)
        for index, item in enumerate(checked):
            stacked[index, :, : item.shape[1]] = item
        device = next(self.codec.parameters()).device
        with torch.no_grad():
            audio = self.codec.decode(stacked.to(device)).audio_values  # [batch, samples]
        audio = audio.reshape(len(items), -1).float().cpu()
        return [audio[index, : count * self.samples_per_frame] for index, count in enumerate(frames)]

    def decode(self, codes: torch.Tensor | Sequence[torch.Tensor], lengths: Sequence[int] | None = None):
        """One item ([frames, num_codebooks], or rows [rows, 1 + num_codebooks]) -> a waveform; a
        batch -> a list (see `batch_decode`)."""
        if isinstance(codes, torch.Tensor) and codes.ndim == 2:
            return self.batch_decode(codes[None], lengths)[0]
        return self.batch_decode(codes, lengths)

    def spoken_frames(self, rows: torch.Tensor) -> torch.Tensor:
        """The frames [frames, num_codebooks] of the voice turn one item's rows [rows, 1 +
        num_codebooks] end in (`prompting.bare_rows.spoken_frames`): of `generate()`'s `sequences`,
        its take (and any frames the prompt's voice turn already held)."""
        ids = self.token_ids
        rows = torch.as_tensor(rows).long().cpu()
        if rows.ndim != 2 or rows.shape[-1] != self.num_codebooks + 1:
            raise ValueError(f"rows: expected [rows, 1 + {self.num_codebooks}]; got {tuple(rows.shape)}")
        return spoken_frames(rows, ids.semantic_start, ids.codebook_size, ids.special[IM_END], ids.pad, self.audio_separator_token_id)

    def save_audio(self, audio: torch.Tensor | np.ndarray, path: str | os.PathLike, sampling_rate: int | None = None) -> None:
        """Write a 1-D waveform as WAV or FLAC (from the file extension), 16-bit PCM, through a
        temporary file beside `path`: a failed write leaves an existing file as it was."""
        extension = os.path.splitext(os.fspath(path))[1].lower()
        if extension not in AUDIO_FORMATS:
            raise ValueError(f"path: write .wav or .flac; got {os.fspath(path)!r}")
        if isinstance(audio, torch.Tensor):
            audio = audio.detach().to("cpu", torch.float32).numpy()
        samples = np.asarray(audio, dtype=np.float32).squeeze()
        if samples.ndim != 1:
            raise ValueError(f"audio: expected one waveform [samples]; got shape {samples.shape}")
        with atomic_output(path) as temporary:
            soundfile.write(
                temporary, np.clip(samples, -1.0, 1.0), sampling_rate or self.sampling_rate,
                format=AUDIO_FORMATS[extension], subtype="PCM_16",
            )


# ---- conversations -> scripts -------------------------------------------------------------------------


def _content_items(message: dict, location: str) -> list[dict]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{location}.content: a string or a list of items; got {type(content).__name__}")
    for index, item in enumerate(content):
        if not isinstance(item, dict) or item.get("type") not in ("text", "audio"):
            raise ValueError(f"{location}.content[{index}]: items are {{'type': 'text'|'audio', ...}}")
    return list(content)


def _audio_clip(item: dict, location: str) -> Clip:
    keys = [key for key in ("path", "url", "audio", "codes") if item.get(key) is not None]
    if len(keys) != 1:
        raise ValueError(f"{location}: an audio item needs exactly one of path, url, audio or codes; got {keys}")
    value = item[keys[0]]
    if keys[0] in ("path", "url"):
        return Clip(path=os.fspath(value))
    if keys[0] == "codes":
        return Clip(codes=value if isinstance(value, (torch.Tensor, np.ndarray)) else np.asarray(value))
    return as_clip(value, location, item.get("sampling_rate"))


def _speaker_role(role: Any) -> int | None:
    if isinstance(role, (int, np.integer)) and not isinstance(role, bool):
        return int(role)
    if isinstance(role, str) and role.isdigit():
        return int(role)
    return None


def conversation_to_script(messages: Sequence[dict], location: str = "conversation") -> Script:
    """A conversation (see `Drama3Processor.apply_chat_template`) -> the equivalent `Script`."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{location}: a conversation is a non-empty list of messages")
    references: list[Reference] = []
    takes: list[Take] = []
    pending: list = []
    for index, message in enumerate(messages):
        where = f"{location}[{index}]"
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"{where}: a message is a dict with 'role' and 'content'")
        role = message["role"]
        items = _content_items(message, where)
        speaker = _speaker_role(role)
        if role in ("system", "user") or speaker is not None:
            default = check_speaker(speaker if speaker is not None else message.get("speaker", 0), f"{where}.role")
            texts: list[str] = []
            for position, item in enumerate(items):
                item_where = f"{where}.content[{position}]"
                if item["type"] == "text":
                    texts.append(item.get("text", ""))
                    continue
                if len(texts) != 1:
                    raise ValueError(
                        f"{item_where}: a reference audio needs exactly one transcript text item before it; "
                        f"got {len(texts)}"
                    )
                item_speaker = check_speaker(item.get("speaker", default), f"{item_where}.speaker")
                references.append(Reference(texts.pop(), _audio_clip(item, item_where), item_speaker))
            if texts and role == "system":
                raise ValueError(f"{where}: system text must be reference transcripts, each followed by its audio")
            pending.extend((text, default, f"{where}.content") for text in texts)
        elif role == "assistant":
            audio = [item for item in items if item["type"] == "audio"]
            if len(audio) != 1 or len(items) != 1:
                raise ValueError(f"{where}: an assistant message holds exactly one audio item (the take)")
            if not pending:
                raise ValueError(f"{where}: a take must follow the lines it speaks")
            takes.append(Take(_pending_lines(pending), _audio_clip(audio[0], f"{where}.content[0]")))
            pending = []
        else:
            raise ValueError(f"{where}.role: 'system', 'user', 'assistant' or a speaker 0-15; got {role!r}")
    if pending:
        return Script(lines=_pending_lines(pending), references=tuple(references), history=tuple(takes))
    if takes:
        *history, last = takes
        return Script(lines=last.lines, references=tuple(references), history=tuple(history), target=last.audio)
    raise ValueError(f"{location}: nothing to speak (no text lines)")


def _pending_lines(pending: list[tuple[str, int, str]]) -> str | tuple:
    """The lines of the text items since the last take: one item is raw text, spoken as given
    (tagged with its message's speaker when no tag leads it); several are read as lines."""
    if len(pending) == 1:
        text, speaker, where = pending[0]
        parse_text(text, where, default_speaker=speaker)
        return with_speaker_tag(text, speaker)
    return tuple(line for text, speaker, where in pending for line in parse_text(text, where, default_speaker=speaker))


# ---- helpers --------------------------------------------------------------------------------------------


# The codecs of this package; a codec of another model_type loads once registered with
# AutoConfig and AutoModel (it needs the interface the processor uses: `encode` returning
# `audio_codes` + `lengths`, `decode` returning `audio_values`, `num_codebooks`, `sampling_rate`,
# `frame_rate`).
PACKAGE_CODECS = (Drama3CodecConfig.model_type, Drama3MelCodecConfig.model_type, Drama3PhoneCodecConfig.model_type)


def _checked_frontend(tokenizer, text_frontend: dict | None) -> dict | None:
    """The text front end: the one the tokenizer records (its vocabulary is made for it), or the
    one given, which must then agree."""
    recorded = getattr(tokenizer, "init_kwargs", {}).get("text_frontend")
    if text_frontend is None or recorded is None:
        return text_frontend if text_frontend is not None else recorded
    if text_frontend != recorded:
        raise ValueError(
            f"text_frontend={text_frontend} disagrees with the tokenizer's recorded {recorded}; give one of them"
        )
    return recorded


def check_codec_model_type(config_file: str) -> None:
    """A saved codec's config.json names a model_type that AutoConfig knows."""
    with open(config_file, encoding="utf-8") as reader:
        model_type = json.load(reader).get("model_type")
    try:
        AutoConfig.for_model(model_type)
    except ValueError:
        raise ValueError(
            f"{config_file}: codec model_type {model_type!r} is not a known codec; known: {sorted(PACKAGE_CODECS)} "
            f"(or any codec registered with transformers' AutoConfig.register and AutoModel.register)"
        ) from None


def load_saved_codec(path: str | os.PathLike, config_file: str, hub: dict):
    """The codec in the `codec/` subfolder of `path` (a folder or Hub repo), built by `AutoModel`
    from the model_type of its config.json."""
    check_codec_model_type(config_file)
    if os.path.isdir(path):
        return AutoModel.from_pretrained(os.path.join(path, "codec"))
    return AutoModel.from_pretrained(path, subfolder="codec", **hub)


def _load_codec(path: str | os.PathLike, kwargs: dict):
    """The codec saved beside a processor (`codec/`, loaded through `AutoModel`), or the published
    `codec.pth` (the S2 codec); None if neither."""
    hub = hub_keywords(kwargs)
    config_file = optional_file(path, "codec/config.json", **hub)
    if config_file is not None:
        return load_saved_codec(path, config_file, hub)
    checkpoint = optional_file(path, "codec.pth", **hub)
    if checkpoint is not None:
        return Drama3CodecModel.from_pretrained(checkpoint)
    return None


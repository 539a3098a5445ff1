"""Drama3Processor: scripts and conversations -> model rows; generated codes -> waveforms.

The class is composed here from its jobs in `processing/` (audio in, rows, the chat template, audio
out); this module holds what makes it a processor: its parts, its settings, saving and loading."""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoTokenizer
from transformers.utils import logging

from .decoding.budget import MIN_SPEECH_FRACTION
from .feature_extraction_drama3 import SAMPLING_RATE, Drama3FeatureExtractor
from .integrations import ProcessorMixinWithOwnParts, hub_keywords
from .processing.audio_in import AudioInputMixin
from .processing.audio_out import AUDIO_FORMATS, AudioOutputMixin  # noqa: F401
from .processing.chat_template import ChatTemplateMixin, conversation_to_script  # noqa: F401
from .processing.rows import RowsMixin
from .processing.saved_codec import PACKAGE_CODECS, check_codec_model_type, codec_beside, load_saved_codec  # noqa: F401
from .prompting import (
    AUDIO_SEPARATOR,
    CHUNK_BYTES,
    CHUNK_SPEAKERS,
    CODEBOOK_SIZE,
    MAX_REFERENCE_SECONDS,
    NUM_CODEBOOKS,
    TokenIds,
)
from .prompting.phonemes import text_frontend as phoneme_front_end

# The names this module defined before its jobs moved into `processing/`: all still importable from here.
__all__ = ["AUDIO_FORMATS", "PACKAGE_CODECS", "SAMPLES_PER_FRAME", "Drama3Processor", "check_codec_model_type",
           "conversation_to_script", "load_saved_codec"]

SAMPLES_PER_FRAME = 2048

# The logger the processor's warnings go to (`processing.audio_in` takes it by this module's name).
logger = logging.get_logger(__name__)


# The jobs last first: the API reference lists inherited methods from the farthest base on, so its page
# reads audio in, rows, chat template, audio out (no method is defined in two of them).
class Drama3Processor(AudioOutputMixin, ChatTemplateMixin, RowsMixin, AudioInputMixin, ProcessorMixinWithOwnParts):
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

    @property
    def samples_per_frame(self) -> int:
        return int(round(self.sampling_rate / self.frame_rate))

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
            codec = codec_beside(pretrained_model_name_or_path, kwargs)
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

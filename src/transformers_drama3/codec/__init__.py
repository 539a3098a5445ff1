"""The S2 audio codec (44.1 kHz, 2048 samples and 10 codes per frame), streaming included."""

from .audio import check_audio, is_silent
from .configuration_codec import Drama3CodecConfig
from .modeling_codec import DecodedAudio, Drama3CodecModel, EncodedAudio

__all__ = [
    "Drama3CodecConfig",
    "Drama3CodecModel",
    "EncodedAudio",
    "DecodedAudio",
    "check_audio",
    "is_silent",
]

"""The S2 audio codec (44.1 kHz, 2048 samples and 10 codes per frame), streaming included.

    from transformers_drama3.codec import Drama3CodecModel
    codec = Drama3CodecModel.from_pretrained("path/to/codec.pth")      # or an HF folder
    encoded = codec.encode(waveform, sampling_rate=16000)              # codes [batch, 10, frames]
    audio = codec.decode(encoded.audio_codes, encoded.lengths).audio_values  # [batch, samples] at 44.1 kHz

    stream = codec.streaming_decoder()
    for window in stream_decode_windows():                             # 10, 10, 12, 32, 64, ...
        play(stream.push(next_codes(window)))

`Drama3MelCodecModel` (log-mel residual VQ + Griffin-Lim, the drama3-tiny codec) and
`Drama3PhoneCodecModel` (phoneme and voice codes, decoded to log-mel by a small convolutional
network, then Griffin-Lim) have the same interface. `import transformers_drama3` registers
"drama3_codec", "drama3_mel_codec" and "drama3_phone_codec" with `AutoConfig` and `AutoModel`
(`transformers_drama3.register_auto_classes`).
"""

from ..feature_extraction_drama3 import is_inaudible
from .audio import check_audio
from .configuration_codec import Drama3CodecConfig
from .convert import convert_codec_checkpoint
from .mel_codec import Drama3MelCodecConfig, Drama3MelCodecModel, fit_residual_codebooks
from .phone_codec import Drama3PhoneCodecConfig, Drama3PhoneCodecModel
from .modeling_codec import Drama3CodecDecoderOutput, Drama3CodecEncoderOutput, Drama3CodecModel
from .streaming import StreamingDecoder, StreamingEncoder, stream_decode_windows

__all__ = [
    "Drama3CodecConfig",
    "Drama3CodecModel",
    "Drama3MelCodecConfig",
    "Drama3MelCodecModel",
    "Drama3PhoneCodecConfig",
    "Drama3PhoneCodecModel",
    "fit_residual_codebooks",
    "Drama3CodecEncoderOutput",
    "Drama3CodecDecoderOutput",
    "StreamingEncoder",
    "StreamingDecoder",
    "stream_decode_windows",
    "convert_codec_checkpoint",
    "check_audio",
    "is_inaudible",
]

"""Long-form audio is decoded once: every frame of every chunk goes through the codec exactly
once, through one `WaveformStreamer`, whether the call streams (`drama3 say --stream`) or not, and
the streamed waveform is the waveform of the same call without a streamer, sample for sample."""

import numpy as np
import pytest
import soundfile
import torch

from generation_helpers import RecordingStreamer
from transformers_drama3 import cli
from transformers_drama3.codec.take_audio import decode_audio
from transformers_drama3.runtime.long_form import generate_long_form

SENTENCE = "This sentence is long enough that a few of them fill more than one chunk of text. "
TEXT = SENTENCE * 8  # three chunks of at most 300 bytes
SEED, FRAMES = 14, 8  # on the tiny model: takes of 3, 0 and 8 frames, so windows 10 + 1 cross a seam


class DecodedFrames:
    """Counts the codec's decode calls (offline `decode` and the streaming decoder both run
    `decode_frames`) and keeps the codes of each, on every codec of the patched class."""

    def __init__(self, monkeypatch, codec_class):
        self.calls: list[torch.Tensor] = []  # [num_codebooks, frames] of each call (batch 1)
        original = codec_class.decode_frames

        def decode_frames(codec, codes, *args, **kwargs):
            assert codes.shape[0] == 1, "long-form decodes batch 1"
            if codes.shape[-1]:
                self.calls.append(codes[0].detach().cpu().clone())
            return original(codec, codes, *args, **kwargs)

        monkeypatch.setattr(codec_class, "decode_frames", decode_frames)

    def clear(self) -> None:
        self.calls.clear()

    @property
    def frames(self) -> torch.Tensor:
        """Every decoded frame in the order decoded: [frames, num_codebooks]."""
        if not self.calls:
            return torch.zeros(0, 0, dtype=torch.long)
        return torch.cat(self.calls, dim=-1).T


def assert_each_frame_decoded_once(decoded: DecodedFrames, audio_codes: torch.Tensor) -> None:
    assert decoded.frames.shape[0] == audio_codes.shape[0]
    assert torch.equal(decoded.frames, audio_codes.cpu())


def test_a_long_form_call_decodes_each_frame_once_streamed_or_not(speech_bundle, monkeypatch):
    model, processor = speech_bundle
    decoded = DecodedFrames(monkeypatch, type(processor.codec))

    streamer = RecordingStreamer()
    streamed = generate_long_form(model, processor, TEXT, seed=SEED, max_new_tokens=FRAMES, progress=False,
                                  streamer=streamer)
    assert len(streamed.chunks) > 1 and sum(length > 0 for length in streamed.chunk_lengths) > 1
    assert streamed.audio_codes.shape[0] > 10  # more than the first window: the decoder state crosses a seam
    assert_each_frame_decoded_once(decoded, streamed.audio_codes)
    assert len(decoded.calls) == 2  # windows of 10, then the rest
    assert streamer.ends == 1 and streamed.time_to_first_audio is not None
    assert torch.equal(torch.cat(streamer.values), streamed.audio)

    decoded.clear()
    offline = generate_long_form(model, processor, TEXT, seed=SEED, max_new_tokens=FRAMES, progress=False)
    assert torch.equal(offline.audio_codes, streamed.audio_codes)
    assert_each_frame_decoded_once(decoded, offline.audio_codes)
    assert offline.time_to_first_audio is None
    assert torch.equal(streamed.audio, offline.audio)  # the same windows of one streaming decoder

    # one offline pass over the whole take rounds differently from the windowed streaming decoder
    decoded.clear()
    whole = decode_audio(processor.codec, offline.audio_codes[None], torch.tensor([offline.audio_codes.shape[0]]))[0]
    assert len(decoded.calls) == 1
    torch.testing.assert_close(offline.audio, whole, rtol=0, atol=1e-3)


def test_a_long_form_call_with_the_progress_bar_decodes_each_frame_once(speech_bundle, monkeypatch):
    """The bar relays the streamed frames; it must not add a decode or lose a frame."""
    model, processor = speech_bundle
    decoded = DecodedFrames(monkeypatch, type(processor.codec))
    streamer = RecordingStreamer()
    out = generate_long_form(model, processor, TEXT, seed=SEED, max_new_tokens=FRAMES, progress=True,
                             streamer=streamer)
    assert_each_frame_decoded_once(decoded, out.audio_codes)
    assert torch.equal(torch.cat(streamer.values), out.audio)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint[0]


def say(checkpoint, output, *extra) -> int:
    return cli.main(["say", TEXT, "-o", str(output), "--model", checkpoint, "--max-frames", str(FRAMES),
                     "--seed", str(SEED), "--quiet", *extra])


def test_say_stream_decodes_each_frame_once_and_writes_the_unstreamed_file(checkpoint, tmp_path, monkeypatch):
    from transformers_drama3.codec import Drama3CodecModel

    outputs = []
    speak = cli.generate_long_form

    def recording_generate_long_form(*args, **kwargs):
        outputs.append(speak(*args, **kwargs))
        return outputs[-1]

    monkeypatch.setattr(cli, "generate_long_form", recording_generate_long_form)
    decoded = DecodedFrames(monkeypatch, Drama3CodecModel)

    assert say(checkpoint, tmp_path / "streamed.wav", "--stream") == 0
    (streamed,) = outputs
    assert len(streamed.chunks) > 1 and streamed.audio_codes.shape[0] > 10
    assert_each_frame_decoded_once(decoded, streamed.audio_codes)

    decoded.clear()
    assert say(checkpoint, tmp_path / "offline.wav") == 0
    offline = outputs[1]
    assert torch.equal(offline.audio_codes, streamed.audio_codes)
    assert_each_frame_decoded_once(decoded, offline.audio_codes)

    streamed_audio, rate = soundfile.read(tmp_path / "streamed.wav", dtype="int16")
    offline_audio, _ = soundfile.read(tmp_path / "offline.wav", dtype="int16")
    assert rate == 44100 and streamed_audio.size == streamed.audio.numel() > 0
    np.testing.assert_array_equal(streamed_audio, offline_audio)
    assert (tmp_path / "streamed.wav").read_bytes() == (tmp_path / "offline.wav").read_bytes()

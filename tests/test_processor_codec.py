"""Drama3Processor with a (tiny, random) codec: audio in, codes out, saving the codec."""

import numpy as np
import pytest
import soundfile
import soxr
import torch

from codec_helpers import tiny_codec
from processor_helpers import tiny_tokenizer
from transformers_drama3.processing_drama3 import Drama3Processor
from transformers_drama3.prompting import Infill, Reference, Script


@pytest.fixture(scope="module")
def processor():
    # references here are 30-100 ms placeholders with a word of transcript: no length check
    return Drama3Processor(tiny_tokenizer(), codec=tiny_codec(), min_reference_fraction=0.0)


def voice(seconds: float = 0.03, rate: int = 44100, seed: int = 0) -> np.ndarray:
    generator = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * generator.standard_normal(t.shape)).astype(np.float32)


def test_the_processor_takes_its_sizes_from_the_codec(processor):
    codec = processor.codec
    assert processor.num_codebooks == codec.num_codebooks == 4
    assert processor.sampling_rate == codec.sampling_rate
    assert processor.frame_rate == codec.frame_rate
    assert processor.samples_per_frame == codec.hop_length


def test_a_waveform_reference_gives_the_rows_of_its_codes(processor):
    wave = voice()
    encoded = processor.codec.encode(torch.from_numpy(wave)[None], sampling_rate=44100)
    codes = encoded.audio_codes[0, :, : int(encoded.lengths[0])]
    by_audio = processor("Hello.", reference_audio=wave, reference_text="Ref.")
    by_codes = processor("Hello.", reference_audio=codes, reference_text="Ref.")
    assert torch.equal(by_audio["input_ids"], by_codes["input_ids"])
    assert torch.equal(by_audio["audio_codes"], by_codes["audio_codes"])
    assert by_audio["audio_codes"].shape[-1] == 4


def test_a_file_reference_equals_the_same_samples_in_memory(processor, tmp_path):
    wave = voice(seed=1)
    path = tmp_path / "ref.wav"
    soundfile.write(path, wave, 44100, subtype="FLOAT")
    by_file = processor(Script("Hi.", references=[Reference("Ref.", str(path))]))
    by_url = processor(Script("Hi.", references=[Reference("Ref.", path.as_uri())]))
    by_array = processor(Script("Hi.", references=[Reference("Ref.", wave)]))
    assert torch.equal(by_file["input_ids"], by_array["input_ids"])
    assert torch.equal(by_url["input_ids"], by_array["input_ids"])


def test_other_sampling_rates_are_resampled_to_the_codec_rate(processor):
    wave = voice(rate=22050, seed=2)
    resampled = soxr.resample(wave, 22050, 44100).astype(np.float32)
    a = processor("Hi.", reference_audio=wave, reference_text="r", sampling_rate=22050)
    b = processor("Hi.", reference_audio=resampled, reference_text="r")
    assert torch.equal(a["audio_codes"], b["audio_codes"])


def test_a_silent_reference_is_refused(processor):
    with pytest.raises(ValueError, match=r"references\[0\]\.audio: the audio is silent"):
        processor("Hi.", reference_audio=np.zeros(4410, dtype=np.float32), reference_text="r")


def test_a_reference_over_sixty_seconds_is_refused_before_encoding(processor):
    wave = np.full(61 * 44100, 0.1, dtype=np.float32)
    with pytest.raises(ValueError, match="61.0 s long"):
        processor("Hi.", reference_audio=wave, reference_text="r")


def test_infill_on_source_audio_keeps_the_frames_outside_the_window(processor):
    wave = voice(seconds=0.03, seed=3)
    codes = processor.codes_of(Infill("x", source=wave, start=0, end=1, unit="frames").source, "source")
    frames = codes.shape[1]
    window = (4 / processor.frame_rate, 9 / processor.frame_rate)
    infill = Infill("Edited.", source=wave, start=window[0], end=window[1])
    prefix, suffix = infill.kept_codes(processor.layout_context())
    assert torch.equal(prefix, codes[:, :4]) and torch.equal(suffix, codes[:, 9:])
    middle = torch.zeros(4, 3, dtype=torch.long)
    assert processor.infill_codes(infill, middle).shape == (4, frames - 5 + 3)


def test_batch_decode_trims_each_item_to_its_frames(processor):
    codes = torch.randint(0, 16, (2, 7, 4))  # [batch, frames, num_codebooks]
    waves = processor.batch_decode(codes, lengths=[7, 3])
    hop = processor.samples_per_frame
    assert [w.shape[0] for w in waves] == [7 * hop, 3 * hop]
    alone = processor.decode(codes[1, :3])
    assert torch.allclose(waves[1], alone, atol=1e-3)  # the codec itself differs by ~2e-4 batched vs alone
    expected = processor.codec.decode(codes[0].T[None]).audio_values[0]
    assert torch.allclose(waves[0], expected, atol=1e-3)


def test_batch_decode_takes_a_list_of_different_lengths(processor):
    items = [torch.randint(0, 16, (5, 4)), torch.randint(0, 16, (2, 4))]
    waves = processor.batch_decode(items)
    assert [w.shape[0] for w in waves] == [5 * processor.samples_per_frame, 2 * processor.samples_per_frame]


def test_batch_decode_refuses_the_codec_layout(processor):
    with pytest.raises(ValueError, match=r"\[batch, frames, 4\]"):
        processor.batch_decode(torch.zeros(1, 4, 7, dtype=torch.long))


def test_save_and_load_keep_the_codec(processor, tmp_path):
    processor.save_pretrained(tmp_path)
    assert (tmp_path / "codec" / "config.json").exists()
    loaded = Drama3Processor.from_pretrained(tmp_path)
    assert loaded.codec is not None and loaded.num_codebooks == 4
    codes = torch.randint(0, 16, (1, 6, 4))
    assert torch.allclose(loaded.batch_decode(codes)[0], processor.batch_decode(codes)[0], atol=1e-6)
    without = Drama3Processor.from_pretrained(tmp_path, load_codec=False)
    assert without.codec is None


def test_decoded_audio_can_be_saved(processor, tmp_path):
    wave = processor.decode(torch.randint(0, 16, (4, 4)))
    processor.save_audio(wave, tmp_path / "out.flac")
    assert soundfile.info(tmp_path / "out.flac").samplerate == processor.sampling_rate

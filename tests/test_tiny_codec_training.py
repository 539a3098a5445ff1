"""The drama3-tiny codec recipe and training loop: the tiny config's sizes, learning on a fixed
batch, exact resume, dead-code restarts, and training codes equal to inference codes."""

import math

import pytest
import torch

from codec_helpers import one_thread, tiny_codec_config as toy_codec_config  # noqa: F401
from transformers_drama3.codec import Drama3CodecModel
from transformers_drama3.tiny.codec_recipe import (
    CodebookUsage,
    RecipeConfig,
    all_vector_quantizers,
    initialise_for_training,
    reconstruct_for_training,
    restart_dead_codes,
    tiny_codec_config,
)
from transformers_drama3.tiny.codec_training import CodecTraining

pytestmark = pytest.mark.usefixtures("one_thread")


def toy_recipe(**overrides) -> RecipeConfig:
    sizes = dict(
        segment_frames=8, batch_size=2, lr_warmup_steps=1, learning_rate=1e-3, mel_fft_sizes=(64, 128),
        mel_bins=(16, 32), bypass_steps=2, bypass_decay_steps=2, restart_every=2, recent_vectors=64,
    )
    sizes.update(overrides)
    return RecipeConfig(**sizes)


def toy_audio(count=3, seconds=0.05, rate=44100) -> list[torch.Tensor]:
    """Harmonic tones with a silent gap: a little structure to learn, and exact digital silence."""
    t = torch.arange(int(seconds * rate)) / rate
    out = []
    for index in range(count):
        pitch = 150.0 + 70.0 * index
        tone = sum(torch.sin(2 * math.pi * pitch * k * t) / k for k in (1, 2, 3)) * 0.2
        out.append(tone * (t < 0.7 * seconds))
    return out


def test_tiny_config_has_about_21_5_frames_per_second_and_at_most_10_codebooks():
    config = tiny_codec_config()
    config.validate_codec_sizes()
    assert config.frame_rate == pytest.approx(21.53, abs=0.05)
    assert config.num_codebooks <= 10


def test_tiny_config_round_trips_through_save_and_load(tmp_path):
    torch.manual_seed(0)
    model = Drama3CodecModel(tiny_codec_config()).eval()
    model.save_pretrained(tmp_path)
    loaded = Drama3CodecModel.from_pretrained(tmp_path).eval()
    saved, original = loaded.config.to_dict(), model.config.to_dict()
    saved.pop("_name_or_path"), original.pop("_name_or_path")
    assert saved == original
    codes = torch.randint(0, 256, (1, model.num_codebooks, 3))
    assert torch.equal(loaded.decode(codes).audio_values, model.decode(codes).audio_values)


def test_training_steps_lower_the_reconstruction_and_codebook_losses_on_a_fixed_batch():
    recipe = toy_recipe(quantizer_dropout=0.0, input_dither=0.0, learning_rate=3e-3, bypass_steps=10**6)
    run = CodecTraining(toy_codec_config(), recipe, toy_audio(), seed=0)
    batch = run.sample_batch()
    first = run.train_step(batch)
    for _ in range(6):
        last = run.train_step(batch)
    assert last["mel"] < 0.9 * first["mel"]
    assert last["codebook"] < first["codebook"]


def test_resume_reproduces_the_next_step_loss_exactly(tmp_path):
    audio = toy_audio()
    run = CodecTraining(toy_codec_config(), toy_recipe(), audio, seed=3)
    for _ in range(3):
        run.train_step()
    run.save(tmp_path)
    expected = run.train_step()
    resumed = CodecTraining.resume(tmp_path, audio, seed=3)
    assert resumed.step_count == 3
    assert resumed.train_step() == expected


def test_dead_code_restart_replaces_unused_codes_with_recent_encoder_vectors():
    model = Drama3CodecModel(toy_codec_config())
    usage = CodebookUsage.empty(model, recent_vectors=16)
    quantizer = all_vector_quantizers(model)[0]
    size, dim = quantizer.codebook.weight.shape
    usage.counts[0] = torch.zeros(size)
    usage.counts[0][:4] = 0.25  # codes 0-3 carry everything
    usage.recent[0] = torch.full((16, dim), 7.0)
    usage.filled[0] = 16
    live = quantizer.codebook.weight[:4].clone()
    restarted = restart_dead_codes(model, usage, threshold=0.1, generator=torch.Generator().manual_seed(0))
    assert restarted[0] == size - 4
    assert torch.equal(quantizer.codebook.weight[:4], live)
    assert torch.allclose(quantizer.codebook.weight[4:], torch.full((size - 4, dim), 7.0), atol=0.01)


def test_training_codes_are_the_codes_the_model_encodes():
    torch.manual_seed(0)
    model = Drama3CodecModel(toy_codec_config()).eval()
    initialise_for_training(model, torch.Generator().manual_seed(0))
    audio = torch.stack(toy_audio(2, seconds=0.02))[:, : 16 * model.hop_length]
    everything = torch.full((2,), model.num_codebooks)
    with torch.no_grad():
        _, step = reconstruct_for_training(model, audio, everything, torch.zeros(2, dtype=torch.bool))
        assert torch.equal(step["codes"], model.encode_frames(audio))


def test_training_loop_restarts_codes_its_batches_never_use():
    recipe = toy_recipe(usage_decay=0.5, restart_every=4, bypass_steps=0, bypass_decay_steps=0)
    run = CodecTraining(toy_codec_config(), recipe, toy_audio(), seed=0)
    restarted = sum(run.train_step().get("restarted", 0) for _ in range(8))
    assert restarted > 0

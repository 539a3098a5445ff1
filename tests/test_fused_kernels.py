"""The Triton kernels of one decode step equal their PyTorch references (run on the CPU through
Triton's interpreter), and the model's own modules compute what the kernels restate."""

import pytest
import torch
from generation_helpers import tiny_model

from transformers_drama3.decoding.counter_noise import codebook_stream, exponentials, seed_keys
from transformers_drama3.decoding.sampler import Drama3Sampler, SamplingSettings
from transformers_drama3.kernels import fused_step

pytest.importorskip("triton")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class KernelsOn:
    """Calls `fused_step.<name>_triton` with its tensors on DEVICE and its result back on the CPU."""

    def __getattr__(self, name):
        kernel = getattr(fused_step, name)

        def call(*args):
            moved = [arg.to(DEVICE) if isinstance(arg, torch.Tensor) else arg for arg in args]
            return kernel(*moved).cpu()

        return call


@pytest.fixture(scope="module")
def interpreted():
    """The kernels, run where they can: compiled on CUDA, else in Triton's interpreter on the CPU
    (tests/conftest.py turns it on before triton is imported)."""
    if not (torch.cuda.is_available() or fused_step.interpreting()):
        pytest.fail("no CUDA and TRITON_INTERPRET is not set: the kernels cannot run (see tests/conftest.py)")
    return KernelsOn()


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- partial codebook fusion

CODEBOOK, CODEBOOKS, DIM, VOCAB, SEMANTIC_START = 64, 10, 40, 200, 120


def fusion_inputs(seed: int, dtype=torch.float32):
    g = generator(seed)
    text = torch.randn(VOCAB, DIM, generator=g).to(dtype)
    codebooks = torch.randn(CODEBOOKS * CODEBOOK, DIM, generator=g).to(dtype)
    ids = torch.randint(0, VOCAB, (3, 7), generator=g)  # text and semantic rows mixed
    codes = torch.randint(-3, CODEBOOK + 3, (3, 7, 4), generator=g)  # out-of-range codes are clamped
    return text, codebooks, ids, codes, SEMANTIC_START, SEMANTIC_START + CODEBOOK - 1, CODEBOOK


def test_partial_codebook_fusion_kernel_equals_its_reference(interpreted):
    inputs = fusion_inputs(0)
    torch.testing.assert_close(
        interpreted.partial_codebook_fusion_triton(*inputs), fused_step.partial_codebook_fusion_reference(*inputs)
    )


def test_partial_codebook_fusion_kernel_equals_its_reference_in_bfloat16(interpreted):
    inputs = fusion_inputs(1, torch.bfloat16)
    out = interpreted.partial_codebook_fusion_triton(*inputs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, fused_step.partial_codebook_fusion_reference(*inputs), rtol=2e-2, atol=2e-2)


def test_the_fusion_reference_is_the_models_embed_rows():
    model = tiny_model(seed=0)
    config = model.config
    g = generator(2)
    ids = torch.randint(0, config.semantic_end_token_id + 1, (2, 6), generator=g)
    codes = torch.randint(0, config.codebook_size, (2, 6, config.num_codebooks), generator=g)
    fused = fused_step.partial_codebook_fusion_reference(
        model.backbone.embed_tokens.weight, model.audio_decoder.codebook_embeddings.weight, ids,
        codes[..., 1 : 1 + model.backbone_codebooks], config.semantic_start_token_id, config.semantic_end_token_id,
        config.codebook_size,
    )
    with torch.no_grad():
        torch.testing.assert_close(fused, model.embed_rows(ids, codes))


# ----------------------------------------------------------------------------- tower injection


def injection_inputs(seed: int, with_extra: bool):
    g = generator(seed)
    table = torch.randn(CODEBOOK, DIM, generator=g)
    codes = torch.randint(-2, CODEBOOK + 2, (3, 2), generator=g)
    audio_weight = (torch.rand(3, 2, 1, generator=g) > 0.3).float()
    extra = torch.randn(3, 2, DIM, generator=g) if with_extra else None
    hidden = torch.randn(3, 2, DIM, generator=g) * 3
    enorm, hnorm = (0.1 * torch.randn(DIM, generator=g) for _ in range(2))
    return table, codes, audio_weight, extra, hidden, enorm, hnorm, 1e-6


@pytest.mark.parametrize("with_extra", [False, True], ids=["plain", "with_extra"])
def test_tower_injection_kernel_equals_its_reference(interpreted, with_extra):
    inputs = injection_inputs(3, with_extra)
    torch.testing.assert_close(interpreted.tower_injection_triton(*inputs), fused_step.tower_injection_reference(*inputs))


def test_the_injection_reference_is_what_a_tower_layer_feeds_eh_proj():
    model = tiny_model(seed=0)
    layer = model.audio_decoder_mtp.layers[0]
    table, codes, audio_weight, extra, hidden, _, _, _ = injection_inputs(4, True)
    dim = model.config.audio_decoder_config.dim
    table = layer.embedding.weight
    extra, hidden = extra[..., :1].expand(3, 2, dim).contiguous(), torch.randn(3, 2, dim, generator=generator(5))
    seen = {}
    layer.eh_proj.register_forward_pre_hook(lambda module, args: seen.update(input=args[0]))
    rotary = model.tower_rotary(torch.zeros(3, 2, dtype=torch.long))
    mask = torch.ones(3, 1, 2, 2, dtype=torch.bool)
    with torch.no_grad():
        layer(hidden, codes, audio_weight, rotary, mask, None, extra)
    expected = fused_step.tower_injection_reference(
        table, codes, audio_weight, extra, hidden, layer.enorm.weight, layer.hnorm.weight, layer.enorm.eps
    )
    torch.testing.assert_close(seen["input"], expected)


# ----------------------------------------------------------------------------- the codebook heads' draw


def race_inputs(seed: int, rows: int = 6, vocab: int = 300):
    g = generator(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    return logits, noise


@pytest.mark.parametrize(
    "temperature, top_k, top_p, keep_crossing",
    [(1.0, 30, 0.9, False), (0.7, 30, 0.7, False), (1.0, 5, 1.0, False), (1.3, 30, 0.95, True), (1.0, 1, 0.5, False)],
)
def test_filtered_race_kernel_draws_what_the_reference_draws(interpreted, temperature, top_k, top_p, keep_crossing):
    logits, noise = race_inputs(6)
    drawn = interpreted.filtered_race_triton(logits, noise, temperature, top_k, top_p, keep_crossing)
    expected = fused_step.filtered_race_reference(logits, noise, temperature, top_k, top_p, keep_crossing)
    # The two paths compute the race's scores p_i / noise_i with different float arithmetic, so a row
    # may only pick differently where its two winners score equal within float32 rounding.
    scores = fused_step.filtered_probabilities(logits, temperature, top_k, top_p, keep_crossing) / noise
    for row in torch.nonzero(drawn != expected).flatten().tolist():
        best, picked = scores[row, expected[row]], scores[row, drawn[row]]
        torch.testing.assert_close(picked, best, rtol=1e-5, atol=1e-7, msg=f"row {row}: not a rounding tie")
    assert (drawn == expected).float().mean() >= 5 / 6


def test_filtered_race_kernel_at_a_tiny_temperature_is_greedy(interpreted):
    logits, noise = race_inputs(7)
    assert torch.equal(interpreted.filtered_race_triton(logits, noise, 1e-6, 30, 0.9, False), logits.argmax(-1))


def test_filtered_race_kernel_samples_the_filtered_distribution(interpreted):
    """Many draws of one row: the kernel's frequencies match the reference's filtered distribution."""
    draws, vocab = 1500, 16
    logits = torch.randn(1, vocab, generator=generator(8)).expand(draws, vocab).contiguous()
    noise = torch.empty(draws, vocab).exponential_(generator=generator(9))
    drawn = interpreted.filtered_race_triton(logits, noise, 1.0, 8, 0.9, False)
    frequencies = torch.bincount(drawn, minlength=vocab).float() / draws
    expected = fused_step.filtered_probabilities(logits[:1], 1.0, 8, 0.9, False)[0]
    assert torch.all(frequencies[expected == 0] == 0)
    torch.testing.assert_close(frequencies, expected, atol=0.05, rtol=0)  # 4 sigma at 1500 draws


def test_filtered_race_kernel_matches_the_reference_where_noise_is_infinite(interpreted):
    logits, noise = race_inputs(10, rows=4, vocab=50)
    noise[:, 20:] = float("inf")  # what `counter_noise.exponentials` gives candidates past an item's width
    logits[:2, 30] = 50.0  # rows 0-1: the only kept candidate lies past the width (every score is 0)
    drawn = interpreted.filtered_race_triton(logits, noise, 1.0, 30, 0.9, False)
    assert torch.equal(drawn, fused_step.filtered_race_reference(logits, noise, 1.0, 30, 0.9, False))


def test_seeded_codebook_draws_use_the_reference_path_on_cpu():
    """On CPU the sampler runs the reference; the kernel path divides by the same noise."""
    logits = torch.randn(3, 1, 64, generator=generator(11))
    settings = SamplingSettings()
    window = torch.full((3, 16), -1)
    keys = seed_keys(range(3))
    sampler = Drama3Sampler(settings, torch.arange(65), window, keys)
    drawn = sampler.codebook(logits, 1)[:, 0]
    noise = exponentials(keys, torch.zeros(3, dtype=torch.long), codebook_stream(1), 64)
    expected = fused_step.filtered_race_reference(logits[:, -1], noise, 1.0, settings.codebook_top_k, settings.top_p, False)
    assert torch.equal(drawn, expected)


def test_cpu_tensors_never_take_a_kernel():
    inputs = injection_inputs(12, True)
    assert not fused_step.use_kernel(inputs[4])
    assert torch.equal(fused_step.tower_injection(*inputs), fused_step.tower_injection_reference(*inputs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernels_equal_their_references_on_cuda():
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in injection_inputs(13, True)]
    torch.testing.assert_close(fused_step.tower_injection(*inputs), fused_step.tower_injection_reference(*inputs))
    logits, noise = (t.cuda() for t in race_inputs(14))
    assert torch.equal(
        fused_step.filtered_race(logits, noise, 1.0, 30, 0.9, False),
        fused_step.filtered_race_reference(logits, noise, 1.0, 30, 0.9, False),
    )

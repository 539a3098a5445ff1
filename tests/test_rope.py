"""The one interleaved RoPE helper, against a plain complex-number rotation and the properties
attention relies on; the tower and the codec's transformers both call it."""

import math

import pytest
import torch

from transformers_drama3.layers.rope import apply_interleaved_rope, rope_cos_sin


def complex_rotation(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    """Oracle in float64: pair (x[2i], x[2i+1]) is the complex number x[2i] + j x[2i+1], times
    exp(j * position * base^(-2i / rotary_dim)). x [time, head_dim], positions [time]."""
    x = x.double()
    pairs = torch.view_as_complex(x[:, :rotary_dim].reshape(x.shape[0], -1, 2).contiguous())
    frequencies = torch.tensor([base ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)], dtype=torch.float64)
    turned = pairs * torch.polar(torch.ones_like(frequencies), positions.double()[:, None] * frequencies)
    return torch.cat([torch.view_as_real(turned).flatten(1), x[:, rotary_dim:]], dim=1)


@pytest.mark.parametrize("rotary_dim, head_dim, base", [(16, 16, 10000.0), (8, 32, 1e7)], ids=["full", "partial"])
def test_rotation_matches_complex_multiplication(rotary_dim, head_dim, base):
    x = torch.randn(40, head_dim)
    positions = torch.arange(40) * 7
    cos, sin = rope_cos_sin(positions, rotary_dim, base)
    assert cos.shape == sin.shape == (40, rotary_dim // 2) and cos.dtype == torch.float32
    rotated = apply_interleaved_rope(x, cos, sin)
    torch.testing.assert_close(rotated.double(), complex_rotation(x, positions, rotary_dim, base), rtol=1e-5, atol=1e-4)


def test_features_past_rotary_dim_pass_through_unchanged():
    x = torch.randn(2, 5, 3, 32)
    cos, sin = rope_cos_sin(torch.arange(5)[None, :, None], 8, 1e6)
    assert torch.equal(apply_interleaved_rope(x, cos, sin)[..., 8:], x[..., 8:])


def test_position_zero_is_the_identity():
    x = torch.randn(4, 3, 16)
    cos, sin = rope_cos_sin(torch.zeros(4, 1, dtype=torch.long), 16, 10000.0)
    assert torch.equal(apply_interleaved_rope(x, cos, sin), x)


def test_query_key_scores_depend_only_on_the_distance():
    """Why attention uses it: <rope(q, m), rope(k, n)> is a function of m - n."""
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        cos, sin = rope_cos_sin(torch.tensor([m, n]), 16, 10000.0)
        pair = apply_interleaved_rope(torch.stack([q, k]), cos.double(), sin.double())
        return float(pair[0] @ pair[1])

    assert math.isclose(score(3, 1), score(103, 101), rel_tol=1e-5)
    assert math.isclose(score(50, 50), float(q @ k), rel_tol=1e-5)


def test_low_precision_inputs_are_rotated_in_float32_and_keep_their_dtype():
    x = torch.randn(6, 2, 16).to(torch.bfloat16)
    cos, sin = rope_cos_sin(torch.arange(6)[:, None] * 1000, 16, 10000.0)
    rotated = apply_interleaved_rope(x, cos, sin)
    assert rotated.dtype == torch.bfloat16
    assert torch.equal(rotated, apply_interleaved_rope(x.float(), cos, sin).to(torch.bfloat16))


def test_float64_stays_float64():
    x = torch.randn(3, 8, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(3), 8, 10000.0)
    assert apply_interleaved_rope(x, cos.double(), sin.double()).dtype == torch.float64

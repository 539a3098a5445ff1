"""Interleaved (GPT-J style) rotary position embedding, the one implementation the Codebook-MTP
tower and the codec's window-limited transformers share.

Pair i of a head, features (2i, 2i + 1), turns by the angle `position * base ** (-2i / rotary_dim)`;
features past `rotary_dim` pass through (the tower rotates a quarter of each head, the codec all of
it). transformers' own `apply_rotary_pos_emb` rotates halves (NeoX style), which is different maths
for the same weights, so it cannot stand in.
"""

import torch


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the angles of absolute `positions` (any shape `[...]`) -> two float32 `[..., rotary_dim / 2]`."""
    inverse_frequencies = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device=positions.device).float() / rotary_dim))
    angles = positions.float()[..., None] * inverse_frequencies  # [..., rotary_dim / 2]
    return angles.cos(), angles.sin()


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[2i], x[2i + 1]) of the first `2 * cos.shape[-1]` features of `x` `[..., head_dim]`.

    `cos` and `sin` `[..., rotary_dim / 2]` broadcast against `x[..., :rotary_dim:2]` (e.g. `[1, time, 1,
    half]` for `x` `[batch, time, heads, head_dim]`). Computed in float32 at least (float64 stays
    float64, as reference checks need), returned in `x`'s dtype.
    """
    rotary_dim = 2 * cos.shape[-1]
    wide = x[..., :rotary_dim].to(torch.promote_types(x.dtype, torch.float32))
    even, odd = wide[..., 0::2], wide[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)

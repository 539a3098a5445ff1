"""The sampler's random numbers, computed where they are used: a counter-based generator.

A draw's Exp(1) numbers are a function of four integers: the item's key (from its seed), the
item's step (how many decode steps it has drawn), the stream (the main token, the RAS redraw,
codebook 1..9) and the lane (the candidate's index). Nothing is drawn ahead, nothing is taken
back, and no generator object holds state: the decode step computes its numbers from two `[batch]`
tensors on the device, inside its compiled graph (CUDA graphs replay it), so a seeded item draws
the same numbers whatever else is in the batch, eagerly or compiled, on any device (integer
arithmetic is exact everywhere, and the float steps after it are one division and one log).

The hash is Wellons' "lowbias32" (two xorshift-multiply rounds, a bijection of 32-bit words with
low avalanche bias), applied as a keyed chain. Its multiplications are done on 16-bit halves in
int64, so no intermediate overflows on any backend: `(x * c) mod 2^32 = (lo(x) * c + ((hi(x) * c)
mod 2^16) * 2^16) mod 2^32`. A uniform keeps the hash's top 24 bits, `(h >> 8 + 0.5) / 2^24`, which
float32 holds exactly; its Exp(1) number is `-log(u)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

WORD = 0xFFFFFFFF
_HALF = 0xFFFF
_ROUND_1, _ROUND_2 = 0x7FEB352D, 0x846CA68B
_STREAM_SPREAD = 0x9E3779B9  # the 32-bit golden ratio: consecutive streams land far apart

MAIN_STREAM = 0
"""The main token's first draw."""
RAS_STREAM = 1
"""The main token's RAS redraw."""


def codebook_stream(codebook_index: int) -> int:
    """The stream of acoustic codebook `codebook_index` (1..num_codebooks - 1)."""
    return 1 + codebook_index


def _times(x: torch.Tensor, constant: int) -> torch.Tensor:
    """`(x * constant) mod 2^32` for int64 `x` in [0, 2^32), without overflowing int64."""
    return ((x & _HALF) * constant + ((((x >> 16) * constant) & _HALF) << 16)) & WORD


def mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of each 32-bit word of int64 `x` (values in [0, 2^32))."""
    x = x ^ (x >> 16)
    x = _times(x, _ROUND_1)
    x = x ^ (x >> 15)
    x = _times(x, _ROUND_2)
    return x ^ (x >> 16)


def seed_keys(seeds: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """The key of each seed: long `[len(seeds)]` in [0, 2^32). Any int seeds (negative and
    64-bit ones too: both halves of the two's-complement word go into the key)."""
    words = [int(seed) & 0xFFFFFFFFFFFFFFFF for seed in seeds]
    low = torch.tensor([word & WORD for word in words], dtype=torch.long)
    high = torch.tensor([word >> 32 for word in words], dtype=torch.long)
    return mix(mix(high) ^ low).to(device)


def random_keys(batch: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Keys for items without a seed, drawn from torch's global CPU generator (so
    `torch.manual_seed` makes an unseeded run repeat): long `[batch]` in [0, 2^32)."""
    return torch.randint(0, 2**32, (batch,), dtype=torch.long).to(device)


def uniforms(keys: torch.Tensor, steps: torch.Tensor, stream: int, lanes: int) -> torch.Tensor:
    """float32 `[batch, lanes]` in (0, 1): item b's numbers at its step `steps[b]` on `stream`,
    lane j at column j. keys, steps: long `[batch]`."""
    spread = (stream * _STREAM_SPREAD) & WORD
    at_step = mix(mix(keys ^ spread) ^ (steps & WORD))  # [batch]: one word per item and step
    lane = torch.arange(lanes, device=keys.device, dtype=torch.long)
    words = mix(mix(lane[None, :] ^ at_step[:, None]) ^ keys[:, None])
    return ((words >> 8).float() + 0.5) * (1.0 / 2**24)


def exponentials(keys: torch.Tensor, steps: torch.Tensor, stream: int, lanes: int, widths: torch.Tensor | None = None) -> torch.Tensor:
    """Exp(1) numbers `[batch, lanes]` (see `uniforms`); `inf` at lanes >= `widths[b]` (a
    candidate item b may not draw: it never wins an exponential race)."""
    numbers = -torch.log(uniforms(keys, steps, stream, lanes))
    if widths is None:
        return numbers
    lane = torch.arange(lanes, device=keys.device)
    return numbers.masked_fill(lane[None, :] >= widths[:, None], float("inf"))

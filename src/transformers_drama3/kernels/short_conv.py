"""The Gated DeltaNet's short convolution on one decode row: one Triton kernel beside its reference.

On a decode row each Gated DeltaNet layer of the backbone runs transformers' `causal_conv1d_update`:
the conv state (the last `state_len` inputs of every channel) rolls by one column, the new input
becomes its last column, and a depthwise convolution over the last `width` columns (weights
`[channels, width]`, optional bias) gives the output, SiLU-activated. Without the `causal_conv1d`
package transformers runs its PyTorch reference for it: a cat, a copy into the state, a grouped
conv1d, a slice and an activation per layer. `short_conv_update` does all of it in one kernel that
reads and writes each state column once, updating the state in place.

The kernel is registered as the custom op `torch.ops.drama3.short_conv_update` (it mutates
`conv_state`, declared as such), so a compiled decode step holds it as one opaque op: no graph
break, no host sync, and torch's functionalisation knows the state changes. `short_conv_update`
calls the op; `short_conv_update_reference` is the PyTorch function it must equal (transformers'
`causal_conv1d_update` for one row, restated). `kernel_serves` says when the op can serve a call
(a CUDA row, Triton installed); `kernels.device_dispatch` routes transformers' calls by it. The tests
run the op on CPU tensors through Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cuda_paths import takes_cuda_path
from .fused_step import kernels_wanted

triton = None
if kernels_wanted():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        triton = None

ACTIVATIONS = (None, "silu", "swish")
"""The activations the kernel applies: none, or SiLU under either of transformers' names."""

BLOCK_CHANNELS = 128
"""Channels per program (a power of two; the published conv has 8,192 channels)."""


def triton_available() -> bool:
    return triton is not None


# ----------------------------------------------------------------------------- reference


def short_conv_update_reference(
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """hidden_states [batch, channels, 1]; conv_state [batch, channels, state_len] (updated in
    place); weight [channels, width], state_len >= width - 1; bias [channels] or None ->
    [batch, channels, 1] in hidden_states' dtype. Computed in weight's dtype, as transformers does."""
    window = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)  # [batch, channels, state_len + 1]
    conv_state.copy_(window[..., 1:])
    out = F.conv1d(window, weight[:, None, :], bias, groups=weight.shape[0])[..., -1:]  # [batch, channels, 1]
    if activation is not None:
        out = F.silu(out)
    return out.to(hidden_states.dtype)


def check_inputs(hidden_states, conv_state, weight, bias, activation) -> None:
    """Raise ValueError naming the input that does not fit one decode row of the short conv."""
    if hidden_states.dim() != 3 or hidden_states.shape[-1] != 1:
        raise ValueError(f"hidden_states: expected [batch, channels, 1] (one row), got {tuple(hidden_states.shape)}")
    batch, channels, _ = hidden_states.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"weight: expected [{channels}, width], got {tuple(weight.shape)}")
    width = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[:2] != (batch, channels) or conv_state.shape[2] < width - 1:
        raise ValueError(
            f"conv_state: expected [{batch}, {channels}, state_len] with state_len >= width - 1 = {width - 1}, "
            f"got {tuple(conv_state.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"bias: expected [{channels}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def kernel_serves(hidden_states: torch.Tensor, activation: str | None) -> bool:
    """Whether the op serves this call: a CUDA row, an activation the kernel applies, no gradient
    wanted (the op has no backward), Triton installed. Everything else keeps transformers' path."""
    return (
        triton is not None
        and takes_cuda_path(hidden_states)
        and hidden_states.dim() == 3
        and hidden_states.shape[-1] == 1
        and activation in ACTIVATIONS
        and not (torch.is_grad_enabled() and hidden_states.requires_grad)
    )


# ----------------------------------------------------------------------------- kernel

if triton is not None:

    @triton.jit
    def _short_conv_update_kernel(
        x_ptr, state_ptr, weight_ptr, bias_ptr, out_ptr,
        channels,
        x_stride_item, x_stride_channel,
        state_stride_item, state_stride_channel, state_stride_column,
        weight_stride_channel, weight_stride_tap,
        STATE_LEN: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        item = tl.program_id(0)
        channel = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = channel < channels
        compute = weight_ptr.dtype.element_ty  # the reference computes in the weight's dtype
        kept = state_ptr.dtype.element_ty
        x = tl.load(x_ptr + item * x_stride_item + channel * x_stride_channel, mask=inside, other=0.0).to(compute)
        row = state_ptr + item * state_stride_item + channel * state_stride_channel
        weights = weight_ptr + channel * weight_stride_channel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        # Columns are read in order and each is written one column to the left after it is read:
        # every store lands on a column already read (by the same thread: same offsets).
        for column in tl.static_range(STATE_LEN):
            old = tl.load(row + column * state_stride_column, mask=inside, other=0.0).to(compute)
            if column >= STATE_LEN - WIDTH + 1:
                tap = column - (STATE_LEN - WIDTH + 1)
                w = tl.load(weights + tap * weight_stride_tap, mask=inside, other=0.0).to(tl.float32)
                acc += w * old.to(tl.float32)
            if column >= 1:
                tl.store(row + (column - 1) * state_stride_column, old.to(kept), mask=inside)
        tl.store(row + (STATE_LEN - 1) * state_stride_column, x.to(kept), mask=inside)
        acc += tl.load(weights + (WIDTH - 1) * weight_stride_tap, mask=inside, other=0.0).to(tl.float32) * x.to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + channel, mask=inside, other=0.0).to(tl.float32)
        # the reference rounds the convolution to the weight's dtype before the activation
        acc = acc.to(compute).to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + item * channels + channel, acc.to(out_ptr.dtype.element_ty), mask=inside)

    def short_conv_update_triton(hidden_states, conv_state, weight, bias=None, activation=None) -> torch.Tensor:
        """The kernel (any device Triton runs on): `short_conv_update_reference`'s result, and the
        same update of `conv_state`, in one launch."""
        check_inputs(hidden_states, conv_state, weight, bias, activation)
        batch, channels, _ = hidden_states.shape
        out = torch.empty(batch, channels, 1, dtype=hidden_states.dtype, device=hidden_states.device)
        _short_conv_update_kernel[(batch, triton.cdiv(channels, BLOCK_CHANNELS))](
            hidden_states, conv_state, weight, weight if bias is None else bias, out,
            channels,
            hidden_states.stride(0), hidden_states.stride(1),
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            weight.stride(0), weight.stride(1),
            STATE_LEN=conv_state.shape[-1], WIDTH=weight.shape[-1], HAS_BIAS=bias is not None,
            SILU=activation is not None, BLOCK=BLOCK_CHANNELS,
        )
        return out

    @torch.library.custom_op("drama3::short_conv_update", mutates_args=("conv_state",))
    def _short_conv_update_op(
        hidden_states: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool
    ) -> torch.Tensor:
        return short_conv_update_triton(hidden_states, conv_state, weight, bias, "silu" if silu else None)

    @_short_conv_update_op.register_fake
    def _(hidden_states, conv_state, weight, bias, silu):
        return hidden_states.new_empty(hidden_states.shape[0], hidden_states.shape[1], 1)


def short_conv_update(
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """`short_conv_update_reference` as one op (`torch.ops.drama3.short_conv_update`), for a call
    `kernel_serves`. Updates `conv_state` in place."""
    if triton is None:
        raise RuntimeError("short_conv_update needs Triton (install the package's [gpu] extra)")
    check_inputs(hidden_states, conv_state, weight, bias, activation)
    return torch.ops.drama3.short_conv_update(hidden_states, conv_state, weight, bias, activation is not None)

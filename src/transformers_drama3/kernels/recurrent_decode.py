"""The Gated DeltaNet's recurrent step on one decode row: one Triton kernel beside its reference.

On a decode row each Gated DeltaNet layer of the backbone calls transformers'
`torch_recurrent_gated_delta_rule` with one row and the layer's recurrent state S [batch, v_heads,
k_dim, v_dim]. For every value head (its query/key head is `v_head // (v_heads // heads)`):

    q, k = l2norm(q), l2norm(k)      (when use_qk_l2norm_in_kernel; x * rsqrt(sum x^2 + 1e-6))
    q = q / sqrt(k_dim)
    S = S * exp(g)                   (decay)
    delta = beta * (v - k @ S)       (the delta rule)
    S = S + outer(k, delta)
    o = q @ S

all in float32. transformers binds that function to flash-linear-attention's fused recurrent kernel
for CUDA tensors when fla imports; whether fla's autograd function and launcher trace into a
compiled graph without a break is not something this package can promise, so the decode row gets
its own kernel, registered as the custom op `torch.ops.drama3.gated_delta_rule_decode`: one launch
per layer, one opaque op in a compiled step (no graph break, no host sync). Like transformers'
function it takes the state as input and returns the new one (float32) beside the output; the
cache then copies it into place, as with fla or the reference.

`gated_delta_rule_decode_reference` is the PyTorch function the kernel must equal (transformers'
reference for one row, restated); `kernel_serves` says when the op can serve a call (a CUDA row,
Triton installed); `kernels.device_dispatch` routes transformers' calls by it. The tests run the op
on CPU tensors through Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch

from .cuda_paths import takes_cuda_path
from .fused_step import kernels_wanted

triton = None
if kernels_wanted():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        triton = None

L2NORM_EPS = 1e-6
"""The epsilon of transformers' (and fla's) l2-norm of queries and keys."""

MAX_K_DIM = 256
"""The widest key head the kernel keeps in registers (the published model's is 128)."""


def triton_available() -> bool:
    return triton is not None


# ----------------------------------------------------------------------------- reference


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def gated_delta_rule_decode_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [batch, 1, heads, k_dim]; value [batch, 1, v_heads, v_dim]; g, beta [batch, 1,
    v_heads]; initial_state [batch, v_heads, k_dim, v_dim] or None (zeros) -> the output [batch, 1,
    v_heads, v_dim] in query's dtype and the new state [batch, v_heads, k_dim, v_dim] in float32."""
    heads, v_heads = key.shape[2], value.shape[2]
    q, k = (t[:, 0].float().repeat_interleave(v_heads // heads, dim=1) for t in (query, key))  # [batch, v_heads, k_dim]
    v, decay, b = value[:, 0].float(), g[:, 0].float(), beta[:, 0].float()
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q / q.shape[-1] ** 0.5
    if initial_state is None:
        state = q.new_zeros(*v.shape[:2], q.shape[-1], v.shape[-1])
    else:
        state = initial_state.float()
    state = state * decay.exp()[..., None, None]
    delta = (v - (state * k[..., None]).sum(-2)) * b[..., None]  # [batch, v_heads, v_dim]
    state = state + k[..., None] * delta[..., None, :]
    out = (state * q[..., None]).sum(-2)
    return out[:, None].to(query.dtype), state


def check_inputs(query, key, value, g, beta, initial_state) -> None:
    """Raise ValueError naming the input that does not fit one decode row of the delta rule."""
    if query.dim() != 4 or query.shape[1] != 1:
        raise ValueError(f"query: expected [batch, 1, heads, k_dim] (one row), got {tuple(query.shape)}")
    batch, _, heads, k_dim = query.shape
    if tuple(key.shape) != tuple(query.shape):
        raise ValueError(f"key: expected the query's shape {tuple(query.shape)}, got {tuple(key.shape)}")
    if value.dim() != 4 or value.shape[:2] != (batch, 1) or value.shape[2] % heads:
        raise ValueError(f"value: expected [{batch}, 1, v_heads, v_dim] with v_heads a multiple of {heads}, got {tuple(value.shape)}")
    v_heads, v_dim = value.shape[2:]
    for name, tensor in (("g", g), ("beta", beta)):
        if tuple(tensor.shape) != (batch, 1, v_heads):
            raise ValueError(f"{name}: expected [{batch}, 1, {v_heads}], got {tuple(tensor.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (batch, v_heads, k_dim, v_dim):
        raise ValueError(
            f"initial_state: expected [{batch}, {v_heads}, {k_dim}, {v_dim}], got {tuple(initial_state.shape)}"
        )


def kernel_serves(query: torch.Tensor, cu_seqlens=None) -> bool:
    """Whether the op serves this call: a CUDA decode row (one row, no packed documents), a key head
    of at most `MAX_K_DIM`, no gradient wanted (the op has no backward), Triton installed."""
    return (
        triton is not None
        and takes_cuda_path(query)
        and cu_seqlens is None
        and query.dim() == 4
        and query.shape[1] == 1
        and query.shape[-1] <= MAX_K_DIM
        and not (torch.is_grad_enabled() and query.requires_grad)
    )


# ----------------------------------------------------------------------------- kernel

if triton is not None:

    def _block_v(v_dim: int) -> int:
        """Value columns per program: a few programs per head keep the GPU busy at batch 1."""
        return min(32, triton.next_power_of_2(v_dim))

    @triton.jit
    def _gated_delta_rule_decode_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, new_state_ptr,
        k_dim, v_dim, scale,
        q_stride_item, q_stride_head, k_stride_item, k_stride_head, v_stride_item, v_stride_head,
        g_stride_item, g_stride_head, beta_stride_item, beta_stride_head,
        state_stride_item, state_stride_head, state_stride_k,
        GROUP: tl.constexpr, V_HEADS: tl.constexpr, HAS_STATE: tl.constexpr, L2NORM: tl.constexpr,
        EPS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        item_head = tl.program_id(0)
        item, v_head = item_head // V_HEADS, item_head % V_HEADS
        head = v_head // GROUP
        ks = tl.arange(0, BLOCK_K)
        vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        k_inside, v_inside = ks < k_dim, vs < v_dim
        q = tl.load(q_ptr + item * q_stride_item + head * q_stride_head + ks, mask=k_inside, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + item * k_stride_item + head * k_stride_head + ks, mask=k_inside, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + EPS)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + EPS)
        q = q * scale
        v = tl.load(v_ptr + item * v_stride_item + v_head * v_stride_head + vs, mask=v_inside, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + item * g_stride_item + v_head * g_stride_head).to(tl.float32)
        beta = tl.load(beta_ptr + item * beta_stride_item + v_head * beta_stride_head).to(tl.float32)
        inside = k_inside[:, None] & v_inside[None, :]
        offsets = ks[:, None] * state_stride_k + vs[None, :]
        if HAS_STATE:
            state_block = state_ptr + item * state_stride_item + v_head * state_stride_head
            state = tl.load(state_block + offsets, mask=inside, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
        else:
            state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
        state = state * tl.exp(g)
        delta = beta * (v - tl.sum(state * k[:, None], axis=0))
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + item_head * v_dim + vs, out.to(out_ptr.dtype.element_ty), mask=v_inside)
        new_block = new_state_ptr + item_head * k_dim * v_dim
        tl.store(new_block + ks[:, None] * v_dim + vs[None, :], state, mask=inside)

    def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.stride(-1) == 1 else tensor.contiguous()

    def gated_delta_rule_decode_triton(
        query, key, value, g, beta, initial_state=None, use_qk_l2norm_in_kernel=False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel (any device Triton runs on): `gated_delta_rule_decode_reference` in one launch."""
        check_inputs(query, key, value, g, beta, initial_state)
        batch, _, heads, k_dim = query.shape
        v_heads, v_dim = value.shape[2:]
        query, key, value = (_last_dim_contiguous(t) for t in (query, key, value))
        state = None if initial_state is None else _last_dim_contiguous(initial_state)
        out = torch.empty(batch, 1, v_heads, v_dim, dtype=query.dtype, device=query.device)
        new_state = torch.empty(batch, v_heads, k_dim, v_dim, dtype=torch.float32, device=query.device)
        block_v = _block_v(v_dim)
        source = new_state if state is None else state  # a pointer the kernel never reads without a state
        _gated_delta_rule_decode_kernel[(batch * v_heads, triton.cdiv(v_dim, block_v))](
            query, key, value, g, beta, source, out, new_state,
            k_dim, v_dim, k_dim ** -0.5,
            query.stride(0), query.stride(2), key.stride(0), key.stride(2), value.stride(0), value.stride(2),
            g.stride(0), g.stride(2), beta.stride(0), beta.stride(2),
            source.stride(0), source.stride(1), source.stride(2),
            GROUP=v_heads // heads, V_HEADS=v_heads, HAS_STATE=state is not None, L2NORM=use_qk_l2norm_in_kernel,
            EPS=L2NORM_EPS, BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v,
        )
        return out, new_state

    @torch.library.custom_op("drama3::gated_delta_rule_decode", mutates_args=())
    def _gated_delta_rule_decode_op(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        initial_state: torch.Tensor | None, use_qk_l2norm_in_kernel: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return gated_delta_rule_decode_triton(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)

    @_gated_delta_rule_decode_op.register_fake
    def _(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel):
        batch, _, _, k_dim = query.shape
        v_heads, v_dim = value.shape[2:]
        out = query.new_empty(batch, 1, v_heads, v_dim)
        return out, query.new_empty(batch, v_heads, k_dim, v_dim, dtype=torch.float32)


def gated_delta_rule_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule_decode_reference` as one op (`torch.ops.drama3.gated_delta_rule_decode`),
    for a call `kernel_serves`: (output, new float32 state); `initial_state` is only read."""
    if triton is None:
        raise RuntimeError("gated_delta_rule_decode needs Triton (install the package's [gpu] extra)")
    check_inputs(query, key, value, g, beta, initial_state)
    return torch.ops.drama3.gated_delta_rule_decode(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)

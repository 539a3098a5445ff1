"""The chunked Gated DeltaNet kernel transformers binds, as one op a compiled prefill holds.

With flash-linear-attention installed, transformers binds `torch_chunk_gated_delta_rule` (every
Gated DeltaNet layer of a prefill of more than one row) to fla's `chunk_gated_delta_rule`, which
fla decorates with `torch.compiler.disable`: dynamo does not trace into it, and under
`torch.compile(fullgraph=True)` (the compiled prefill, `generate(..., prefill_graphs=True)`) it
raises "Skip calling torch.compiler.disable()d function" instead. Here the kernel is wrapped as
the custom op `torch.ops.drama3.chunk_gated_delta_rule`, whose fake implementation gives the
output's shape and dtype: the compiled prefill holds fla's kernel as one opaque call, as the
decode step holds the package's decode-row kernels.

Why not trace the PyTorch reference instead: it walks the rows 64 at a time in a Python loop, so a
prefill bucket of 4,096 rows would unroll 64 chunk steps per layer into the graph (a compile of
the 30 Gated DeltaNet layers several times larger), and inductor's kernels would replace fla's.

Inputs, as transformers passes them (fla's layout): query, key [batch, rows, heads, k_dim]; value
[batch, rows, v_heads, v_dim]; g, beta [batch, rows, v_heads]; initial_state [batch, v_heads, k_dim,
v_dim] or None. Outputs: [batch, rows, v_heads, v_dim] in the query's dtype, and the final state
[batch, v_heads, k_dim, v_dim] in float32 (fla's `ChunkGatedDeltaRuleFunction`). The op has no
backward: the routers take it only inside a compiled region without gradients
(`serves_compiled`); training and eager calls call fla directly, as transformers would.

`drama3::chunk_gated_delta_rule_varlen` is the same for packed documents (`cu_seqlens`, batch 1):
fla reads the offsets on the host inside, so `capture_check` names it a host sync (no compiled
path of the package passes packed documents; they are a training input).
"""

from __future__ import annotations

import torch

_BOUND: list = []
"""The kernel the ops call: transformers' binding of `torch_chunk_gated_delta_rule` (fla's kernel),
set by the router that wraps it (`bind`)."""


def bind(kernel) -> None:
    """The function the ops call for CUDA tensors (what transformers bound: fla's kernel)."""
    _BOUND[:] = [kernel]


def bound():
    if not _BOUND:
        raise RuntimeError("no chunked delta-rule kernel is bound: install the device router "
                           "(transformers_drama3.integrations.install_device_dispatch) with flash-linear-attention installed")
    return _BOUND[0]


FLA_OPTIONS = ("scale", "chunk_size", "use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
               "allow_neg_eigval", "state_v_first", "cu_seqlens_cpu", "chunk_indices", "cp_context")
"""Options of fla's kernel the ops do not pass on (transformers' Qwen3.5-MoE passes none of them): a
call that sets one calls the kernel itself."""


def serves_compiled(query: torch.Tensor, options: dict) -> bool:
    """Whether a CUDA call goes through the op: inside a compiled region (where fla's
    `torch.compiler.disable` would stop the trace), without gradients (the op has no backward) and
    without any of `FLA_OPTIONS` set in `options` (the call's other keyword arguments)."""
    return (
        torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and query.requires_grad)
        and not any(options.get(name) not in (None, False) for name in FLA_OPTIONS)
    )


def _final_state(out: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
    # an op returns tensors only: no final state asked is an empty one
    return out.new_empty(0, dtype=torch.float32) if state is None else state


@torch.library.custom_op("drama3::chunk_gated_delta_rule", mutates_args=())
def _chunk_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, state = bound()(query, key, value, g=g, beta=beta, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out, _final_state(out, state)


@_chunk_op.register_fake
def _(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel):
    out = value.new_empty(value.shape, dtype=query.dtype)
    if not output_final_state:
        return out, value.new_empty(0, dtype=torch.float32)
    return out, value.new_empty(value.shape[0], value.shape[2], key.shape[-1], value.shape[-1], dtype=torch.float32)


@torch.library.custom_op("drama3::chunk_gated_delta_rule_varlen", mutates_args=())
def _chunk_varlen_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, output_final_state: bool, use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, state = bound()(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out, _final_state(out, state)


@_chunk_varlen_op.register_fake
def _(query, key, value, g, beta, cu_seqlens, output_final_state, use_qk_l2norm_in_kernel):
    out = value.new_empty(value.shape, dtype=query.dtype)
    if not output_final_state:
        return out, value.new_empty(0, dtype=torch.float32)
    documents = cu_seqlens.shape[0] - 1
    return out, value.new_empty(documents, value.shape[2], key.shape[-1], value.shape[-1], dtype=torch.float32)


def chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The bound kernel through one op (see the module docstring): (output, final state or None)."""
    if cu_seqlens is None:
        out, state = torch.ops.drama3.chunk_gated_delta_rule(
            query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel)
    else:
        if initial_state is not None:
            raise ValueError("packed documents start from an empty state; got an initial_state with cu_seqlens")
        out, state = torch.ops.drama3.chunk_gated_delta_rule_varlen(
            query, key, value, g, beta, cu_seqlens, output_final_state, use_qk_l2norm_in_kernel)
    return out, state if output_final_state else None

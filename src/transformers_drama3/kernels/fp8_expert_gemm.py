"""The routed experts of one MoE layer computed from their block-FP8 weights: a Triton kernel pair
beside the PyTorch reference it must equal.

The published checkpoint stores each routed expert's projections as float8 e4m3 bytes with one
float32 `weight_scale_inv` per `block = (block_out, block_in)` block (`checkpoint/quantization/
block_fp8.py`). Held fused, as transformers holds them:

    gate_up: [experts, 2I, H] e4m3 (gate rows, then up rows)   gate_up_scale: [experts, 2R, ceil(H / block_in)]
    down:    [experts, H, I]  e4m3                             down_scale:    [experts, ceil(H / block_out), ceil(I / block_in)]

with R = ceil(I / block_out): the gate grid, then the up grid (each projection keeps its own
blocks, as in the checkpoint). For rows `hidden: [tokens, H]` routed to `top_k_index: [tokens, k]`
with `top_k_weights: [tokens, k]`, the layer's output is

    out[t] = sum_j top_k_weights[t, j] * down_e (silu(gate_e x_t) * up_e x_t),   e = top_k_index[t, j]

Weight-only: activations stay in their dtype (bfloat16 or float32), products accumulate in float32.

- `fp8_experts_reference`: dequantise the chosen experts' blocks and multiply, `experts_per_chunk`
  experts at a time (a 256-row prefill routed to 8 of 256 experts touches every expert; the dense
  copies of one chunk are all that exists at once). It is what runs on the CPU.
- `fp8_experts_triton`: two kernels over the chosen experts only, each weight tile read as bytes
  and scaled inside the product; no dense expert is ever formed. Two layouts, chosen from shapes:
  - rows (`fp8_experts_triton_rows`, a decode step: at most one assignment per two experts, so
    few experts repeat): one program per (token, slot) computes `silu(gate) * up` of its row, then
    one program per token sums its k experts' down projections times the routing weights and
    writes the output. Two launches and nothing else: no sort, no buffers to reduce.
  - tiles (`fp8_experts_triton_tiles`, a prefill): the (token, slot) assignments are sorted by
    expert and cut into tiles of `BLOCK_M` rows of one expert (`routing_tiles`), so each expert's
    weights are read once per tile; the first kernel computes `silu(gate) * up` of each tile, the
    second the down projection times the routing weight, written per assignment and summed over
    the k slots in a fixed order (deterministic, no atomics). Every shape depends only on `tokens`, `k` and the weights' shapes,
  and nothing is read back to the host, so a decode step holding it can be captured in a CUDA
  graph (the launcher's torch part is checked on the CPU by `capture_check`; the tests capture
  the layer on CUDA where there is a GPU).
- `fp8_experts`: both as one op, `torch.ops.drama3.fp8_experts` (the kernels for CUDA tensors on a
  GPU with e4m3 support, `kernel_serves`; the reference elsewhere), so that `torch.compile(fullgraph=True)` holds the
  whole layer as one opaque call. With a gradient wanted it runs the reference outside the op
  (the op has no backward).

The tests run the kernels on CPU tensors through Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .block_scales import FP8_DTYPE, dequantize_blocks
from .fused_step import interpreting, kernels_wanted

triton = None
if kernels_wanted():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        triton = None

EXPERTS_PER_CHUNK = 8
"""Experts the reference dequantises at once: one chunk of the published model's experts is
8 x 3 x 512 x 2048 weights, 48 MiB in bfloat16 (the whole layer would be 1.5 GiB)."""

MIN_DOT = 16
"""Triton's smallest dot dimension: a tile's rows, and the inner tile, are at least this."""

MAX_ROWS_PER_TILE = 64

PREFILL_CHUNK_ASSIGNMENTS = 32768
"""(token, slot) assignments the tiles layout computes at once: a longer prefill is cut into
chunks of `PREFILL_CHUNK_ASSIGNMENTS // k` tokens (4,096 of the published model's 8 experts a
token), so that its float32 per-assignment buffer stays at 4,096 x 8 x 2,048 x 4 bytes = 256 MiB
(a whole 64 x 4,096-row batch at once would hold 16 GiB). Each chunk reads the experts' weights
again: one more read per 4,096 tokens, against the 32 reads per expert such a chunk's tiles make."""


def triton_available() -> bool:
    return triton is not None


def kernel_takes_block(block: tuple[int, int]) -> bool:
    """Whether the kernels take this scale block: an inner tile never straddles two blocks, so
    `block_in` must be a multiple of `MIN_DOT` (the published 128 is)."""
    return block[1] % MIN_DOT == 0


FP8_CAPABILITY = (8, 9)
"""The CUDA compute capability from which Triton converts float8 e4m3 (Ada, Hopper and later)."""


def kernel_serves(hidden: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether the kernels serve a call: CUDA tensors on a GPU whose Triton reads e4m3
    (`FP8_CAPABILITY`), Triton installed, a block they take. Other calls run the reference."""
    return (
        triton is not None
        and hidden.is_cuda
        and kernel_takes_block(block)
        and torch.cuda.get_device_capability(hidden.device) >= FP8_CAPABILITY
    )


# ----------------------------------------------------------------------------- checks


def check_inputs(hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block) -> None:
    """Raise ValueError naming the input that does not fit the layout of the module docstring."""
    if len(block) != 2 or not all(isinstance(size, int) and size > 0 for size in block):
        raise ValueError(f"block must be two positive integers (block_out, block_in); got {block!r}")
    if hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden: expected floating-point [tokens, hidden], got {tuple(hidden.shape)} {hidden.dtype}")
    tokens, hidden_size = hidden.shape
    if top_k_index.dim() != 2 or top_k_index.shape[0] != tokens or top_k_index.is_floating_point():
        raise ValueError(f"top_k_index: expected integer [{tokens}, k], got {tuple(top_k_index.shape)} {top_k_index.dtype}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"top_k_weights: expected {tuple(top_k_index.shape)} (as top_k_index), got {tuple(top_k_weights.shape)}")
    for name, weight in (("gate_up", gate_up), ("down", down)):
        if weight.dtype != FP8_DTYPE or weight.dim() != 3:
            raise ValueError(f"{name}: expected {FP8_DTYPE} [experts, out, in], got {tuple(weight.shape)} {weight.dtype}")
    experts, intermediate = down.shape[0], down.shape[2]
    if tuple(gate_up.shape) != (experts, 2 * intermediate, hidden_size) or tuple(down.shape) != (experts, hidden_size, intermediate):
        raise ValueError(
            f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)}: expected [experts, 2I, {hidden_size}] and "
            f"[experts, {hidden_size}, I] for hidden of width {hidden_size}"
        )
    expected = {
        "gate_up_scale": (gate_up_scale, (experts, 2 * math.ceil(intermediate / block[0]), math.ceil(hidden_size / block[1]))),
        "down_scale": (down_scale, (experts, math.ceil(hidden_size / block[0]), math.ceil(intermediate / block[1]))),
    }
    for name, (scale, shape) in expected.items():
        if tuple(scale.shape) != shape or scale.dtype != torch.float32:
            raise ValueError(
                f"{name}: expected float32 {shape} (the gate and up grids stacked, block {tuple(block)}), got "
                f"{tuple(scale.shape)} {scale.dtype}"
            )


# ----------------------------------------------------------------------------- reference


def fp8_experts_reference(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    block: tuple[int, int],
    experts_per_chunk: int = EXPERTS_PER_CHUNK,
) -> torch.Tensor:
    """The layer's output `[tokens, H]` in hidden's dtype (layout: the module docstring).

    Each chosen expert's weights are dequantised to hidden's dtype, `experts_per_chunk` experts at
    a time, and multiplied as transformers' dense experts multiply; the weighted sum over the k
    slots accumulates in float32. Differentiable in `hidden` and `top_k_weights`."""
    intermediate = down.shape[2]
    scale_rows = gate_up_scale.shape[1] // 2
    output = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for chunk in torch.unique(top_k_index).split(experts_per_chunk):
        gate = dequantize_blocks(gate_up[chunk, :intermediate], gate_up_scale[chunk, :scale_rows], block, hidden.dtype)
        up = dequantize_blocks(gate_up[chunk, intermediate:], gate_up_scale[chunk, scale_rows:], block, hidden.dtype)
        down_dense = dequantize_blocks(down[chunk], down_scale[chunk], block, hidden.dtype)
        for position, expert in enumerate(chunk.tolist()):
            token, slot = torch.where(top_k_index == expert)
            rows = hidden[token]
            activation = F.silu(rows @ gate[position].T) * (rows @ up[position].T)
            weighted = (activation @ down_dense[position].T).float() * top_k_weights[token, slot, None].float()
            output.index_add_(0, token, weighted)
        # Free this chunk's dense weights before the next chunk's are made.
        del gate, up, down_dense
    return output.to(hidden.dtype)


# ----------------------------------------------------------------------------- routing tiles


def rows_per_tile(assignments: int, num_experts: int) -> int:
    """BLOCK_M: the rows of one expert a program multiplies at once, from the average rows an
    expert gets (16 for a decode step or a 256-row prefill over 256 experts, up to 64)."""
    average = -(-assignments // num_experts)
    return min(MAX_ROWS_PER_TILE, max(MIN_DOT, 1 << max(average - 1, 0).bit_length()))


def tile_count(assignments: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the tiles of `assignments` rows over `num_experts` experts: at most
    min(experts, assignments) experts are used, each in ceil(count / block_m) tiles."""
    used = min(num_experts, assignments)
    return (assignments + used * (block_m - 1)) // block_m


def routing_tiles(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) assignments by expert and cut them into tiles of one expert.

    top_k_index [tokens, k] (values in [0, num_experts)) -> (order [tokens * k] int32: the flat
    assignment `token * k + slot` at each sorted position, stable; tiles [3, n] int32: each tile's
    expert, first sorted position and end position, n = `tile_count`; a tile with start == end is
    unused). Device ops of fixed shapes only: nothing is read back to the host."""
    flat = top_k_index.reshape(-1).long()
    assignments = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, 0)
    tile = torch.arange(tile_count(assignments, num_experts, block_m), device=flat.device)
    expert = torch.searchsorted(tile_end, tile, right=True)
    used = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    row_end = torch.cumsum(counts, 0)
    start = (row_end - counts)[expert] + (tile - (tile_end - tiles_per_expert)[expert]) * block_m
    end = torch.minimum(start + block_m, row_end[expert])
    tiles = torch.stack((expert, torch.where(used, start, 0), torch.where(used, end, 0)))
    return order.to(torch.int32), tiles.to(torch.int32)


def inner_tile(block_in: int) -> int:
    """BLOCK_K: the largest power of two up to 64 that divides `block_in`, so that every inner
    tile lies in one scale block."""
    size = 64
    while block_in % size:
        size //= 2
    return size


def rows_layout_serves(assignments: int, num_experts: int) -> bool:
    """Whether `fp8_experts_triton` takes the rows layout: at most one assignment per two experts
    (a decode step of up to 16 rows over the published 256 experts, 8 each). Then few experts
    repeat, and re-reading a repeated expert costs less than the sort's dozens of small launches.
    A shape rule (no data read), set by that reasoning, not by a measurement."""
    return assignments <= num_experts // 2


# ----------------------------------------------------------------------------- kernels

if triton is not None:

    def _configs():
        """One config under the interpreter (each config is a full slow run there), a few on GPUs."""
        if interpreting():
            return [triton.Config({"BLOCK_N": 32}, num_warps=4)]
        shapes = ((32, 4, 4), (64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3))
        return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in shapes]

    def _row_configs():
        if interpreting():
            return [triton.Config({"BLOCK_N": 32}, num_warps=4)]
        shapes = ((16, 2), (32, 4), (64, 4), (64, 8))
        return [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in shapes]

    @triton.autotune(configs=_row_configs(), key=["hidden_size", "intermediate_size"])
    @triton.jit
    def _gate_up_rows_kernel(
        hidden_ptr, index_ptr, weight_ptr, scale_ptr, activation_ptr,
        hidden_size, intermediate_size, top_k, scale_rows, scale_columns, block_out, block_in,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One (token, slot) assignment x BLOCK_N intermediate columns: silu(x W_gate^T) * (x W_up^T)."""
        assignment = tl.program_id(0)
        expert = tl.load(index_ptr + assignment).to(tl.int64)
        row = hidden_ptr + (assignment // top_k).to(tl.int64) * hidden_size
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_columns = columns < intermediate_size
        weights = weight_ptr + expert * 2 * intermediate_size * hidden_size
        scales = scale_ptr + expert * 2 * scale_rows * scale_columns
        gate_scale_rows = (columns // block_out) * scale_columns
        up_scale_rows = (scale_rows + columns // block_out) * scale_columns
        gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
        up = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in range(0, hidden_size, BLOCK_K):
            inner = k + tl.arange(0, BLOCK_K)
            in_inner = inner < hidden_size
            x = tl.load(row + inner, mask=in_inner, other=0.0).to(tl.float32)
            in_weight = in_columns[:, None] & in_inner[None, :]
            gate_bytes = tl.load(weights + columns[:, None] * hidden_size + inner[None, :], mask=in_weight, other=0.0)
            up_bytes = tl.load(weights + (intermediate_size + columns)[:, None] * hidden_size + inner[None, :],
                               mask=in_weight, other=0.0)
            gate_scale = tl.load(scales + gate_scale_rows + k // block_in, mask=in_columns, other=0.0)
            up_scale = tl.load(scales + up_scale_rows + k // block_in, mask=in_columns, other=0.0)
            gate += tl.sum(gate_bytes.to(tl.float32) * x[None, :], axis=1) * gate_scale
            up += tl.sum(up_bytes.to(tl.float32) * x[None, :], axis=1) * up_scale
        activation = gate * tl.sigmoid(gate) * up
        tl.store(activation_ptr + assignment.to(tl.int64) * intermediate_size + columns,
                 activation.to(activation_ptr.dtype.element_ty), mask=in_columns)

    @triton.autotune(configs=_row_configs(), key=["hidden_size", "intermediate_size"])
    @triton.jit
    def _down_rows_kernel(
        activation_ptr, index_ptr, routing_ptr, weight_ptr, scale_ptr, out_ptr,
        hidden_size, intermediate_size, top_k, scale_rows, scale_columns, block_out, block_in,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One token x BLOCK_N hidden columns: the sum over its k slots of routing weight *
        activation W_down^T, in slot order, written in the output's dtype."""
        token = tl.program_id(0)
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_columns = columns < hidden_size
        scale_row = (columns // block_out) * scale_columns
        out = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for slot in range(top_k):
            assignment = token * top_k + slot
            expert = tl.load(index_ptr + assignment).to(tl.int64)
            weights = weight_ptr + expert * hidden_size * intermediate_size
            scales = scale_ptr + expert * scale_rows * scale_columns
            activation_row = activation_ptr + assignment.to(tl.int64) * intermediate_size
            projected = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k in range(0, intermediate_size, BLOCK_K):
                inner = k + tl.arange(0, BLOCK_K)
                in_inner = inner < intermediate_size
                a = tl.load(activation_row + inner, mask=in_inner, other=0.0).to(tl.float32)
                down_bytes = tl.load(weights + columns[:, None] * intermediate_size + inner[None, :],
                                     mask=in_columns[:, None] & in_inner[None, :], other=0.0)
                scale = tl.load(scales + scale_row + k // block_in, mask=in_columns, other=0.0)
                projected += tl.sum(down_bytes.to(tl.float32) * a[None, :], axis=1) * scale
            out += projected * tl.load(routing_ptr + assignment).to(tl.float32)
        tl.store(out_ptr + token.to(tl.int64) * hidden_size + columns, out.to(out_ptr.dtype.element_ty), mask=in_columns)

    @triton.jit
    def _scaled_dot(x, weight, DOT_IN_FLOAT32: tl.constexpr):
        """x [M, K] @ weight [N, K]^T in float32. Triton's interpreter multiplies bfloat16 dot
        operands wrongly (3.9), so there both go in as float32, exact for bfloat16 and e4m3 values."""
        if DOT_IN_FLOAT32:
            return tl.dot(x.to(tl.float32), tl.trans(weight.to(tl.float32)), input_precision="ieee")
        return tl.dot(x, tl.trans(weight.to(x.dtype)))

    @triton.autotune(configs=_configs(), key=["hidden_size", "intermediate_size", "BLOCK_M"])
    @triton.jit
    def _gate_up_kernel(
        hidden_ptr, tokens_ptr, tiles_ptr, weight_ptr, scale_ptr, activation_ptr,
        hidden_size, intermediate_size, tiles, scale_rows, scale_columns, block_out, block_in,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_IN_FLOAT32: tl.constexpr,
    ):
        """One tile of rows x BLOCK_N intermediate columns: activation = silu(x W_gate^T) * (x W_up^T)."""
        tile = tl.program_id(0)
        start = tl.load(tiles_ptr + tiles + tile)
        end = tl.load(tiles_ptr + 2 * tiles + tile)
        if start < end:
            expert = tl.load(tiles_ptr + tile).to(tl.int64)
            rows = start + tl.arange(0, BLOCK_M)
            in_rows = rows < end
            tokens = tl.load(tokens_ptr + rows, mask=in_rows, other=0).to(tl.int64)
            columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            in_columns = columns < intermediate_size
            weights = weight_ptr + expert * 2 * intermediate_size * hidden_size
            scales = scale_ptr + expert * 2 * scale_rows * scale_columns
            gate_scale_rows = (columns // block_out) * scale_columns
            up_scale_rows = (scale_rows + columns // block_out) * scale_columns
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, hidden_size, BLOCK_K):
                inner = k + tl.arange(0, BLOCK_K)
                in_inner = inner < hidden_size
                x = tl.load(hidden_ptr + tokens[:, None] * hidden_size + inner[None, :],
                            mask=in_rows[:, None] & in_inner[None, :], other=0.0)
                in_weight = in_columns[:, None] & in_inner[None, :]
                gate_bytes = tl.load(weights + columns[:, None] * hidden_size + inner[None, :], mask=in_weight, other=0.0)
                up_bytes = tl.load(weights + (intermediate_size + columns)[:, None] * hidden_size + inner[None, :],
                                   mask=in_weight, other=0.0)
                # One scale per output column: the inner tile lies in one block column.
                gate_scale = tl.load(scales + gate_scale_rows + k // block_in, mask=in_columns, other=0.0)
                up_scale = tl.load(scales + up_scale_rows + k // block_in, mask=in_columns, other=0.0)
                gate += _scaled_dot(x, gate_bytes, DOT_IN_FLOAT32) * gate_scale[None, :]
                up += _scaled_dot(x, up_bytes, DOT_IN_FLOAT32) * up_scale[None, :]
            activation = gate * tl.sigmoid(gate) * up
            tl.store(activation_ptr + rows[:, None].to(tl.int64) * intermediate_size + columns[None, :],
                     activation.to(activation_ptr.dtype.element_ty), mask=in_rows[:, None] & in_columns[None, :])

    @triton.autotune(configs=_configs(), key=["hidden_size", "intermediate_size", "BLOCK_M"])
    @triton.jit
    def _down_kernel(
        activation_ptr, order_ptr, routing_ptr, tiles_ptr, weight_ptr, scale_ptr, out_ptr,
        hidden_size, intermediate_size, tiles, scale_rows, scale_columns, block_out, block_in,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_IN_FLOAT32: tl.constexpr,
    ):
        """One tile of rows x BLOCK_N hidden columns: routing weight * activation W_down^T, written
        at each row's (token, slot) assignment."""
        tile = tl.program_id(0)
        start = tl.load(tiles_ptr + tiles + tile)
        end = tl.load(tiles_ptr + 2 * tiles + tile)
        if start < end:
            expert = tl.load(tiles_ptr + tile).to(tl.int64)
            rows = start + tl.arange(0, BLOCK_M)
            in_rows = rows < end
            columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            in_columns = columns < hidden_size
            weights = weight_ptr + expert * hidden_size * intermediate_size
            scales = scale_ptr + expert * scale_rows * scale_columns
            scale_row = (columns // block_out) * scale_columns
            out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, intermediate_size, BLOCK_K):
                inner = k + tl.arange(0, BLOCK_K)
                in_inner = inner < intermediate_size
                a = tl.load(activation_ptr + rows[:, None].to(tl.int64) * intermediate_size + inner[None, :],
                            mask=in_rows[:, None] & in_inner[None, :], other=0.0)
                down_bytes = tl.load(weights + columns[:, None] * intermediate_size + inner[None, :],
                                     mask=in_columns[:, None] & in_inner[None, :], other=0.0)
                scale = tl.load(scales + scale_row + k // block_in, mask=in_columns, other=0.0)
                out += _scaled_dot(a, down_bytes, DOT_IN_FLOAT32) * scale[None, :]
            assignment = tl.load(order_ptr + rows, mask=in_rows, other=0).to(tl.int64)
            out = out * tl.load(routing_ptr + assignment, mask=in_rows, other=0.0)[:, None]
            tl.store(out_ptr + assignment[:, None] * hidden_size + columns[None, :], out,
                     mask=in_rows[:, None] & in_columns[None, :])


def fp8_experts_triton(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    block: tuple[int, int],
) -> torch.Tensor:
    """The kernels of `fp8_experts` (any device Triton runs on); `fp8_experts_reference`'s result.
    `block[1]` must be a multiple of 16 (`kernel_takes_block`). The rows layout for a decode step,
    the tiles layout otherwise (`rows_layout_serves`)."""
    layout = (
        fp8_experts_triton_rows
        if rows_layout_serves(top_k_index.numel(), down.shape[0])
        else fp8_experts_triton_tiles
    )
    return layout(hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block)


def _check_kernel_block(block: tuple[int, int]) -> None:
    if triton is None:
        raise RuntimeError("the FP8 experts kernels need Triton (install the package's [gpu] extra)")
    if not kernel_takes_block(block):
        raise ValueError(f"block {tuple(block)}: the kernels need block_in a multiple of {MIN_DOT}")


def fp8_experts_triton_rows(hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block):
    """The rows layout of `fp8_experts_triton` (any number of rows; meant for a decode step)."""
    _check_kernel_block(block)
    tokens, hidden_size = hidden.shape
    top_k = top_k_index.shape[1]
    intermediate = down.shape[2]
    if tokens * top_k == 0:
        return torch.zeros_like(hidden)
    index = top_k_index.reshape(-1).contiguous()
    activation = torch.empty(tokens * top_k, intermediate, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty_like(hidden)
    block_k = inner_tile(block[1])
    _gate_up_rows_kernel[lambda meta: (tokens * top_k, triton.cdiv(intermediate, meta["BLOCK_N"]))](
        hidden.contiguous(), index, gate_up.contiguous(), gate_up_scale.contiguous(), activation,
        hidden_size, intermediate, top_k, gate_up_scale.shape[1] // 2, gate_up_scale.shape[2], block[0], block[1],
        BLOCK_K=block_k,
    )
    _down_rows_kernel[lambda meta: (tokens, triton.cdiv(hidden_size, meta["BLOCK_N"]))](
        activation, index, top_k_weights.reshape(-1).contiguous(), down.contiguous(), down_scale.contiguous(), out,
        hidden_size, intermediate, top_k, down_scale.shape[1], down_scale.shape[2], block[0], block[1],
        BLOCK_K=block_k,
    )
    return out


def prefill_chunk_tokens(top_k: int, chunk_assignments: int = PREFILL_CHUNK_ASSIGNMENTS) -> int:
    """Tokens the tiles layout computes at once (`PREFILL_CHUNK_ASSIGNMENTS`)."""
    return max(1, chunk_assignments // top_k)


def tiles_buffer_bytes(tokens: int, top_k: int, hidden_size: int, intermediate: int, element: int,
                       chunk_assignments: int = PREFILL_CHUNK_ASSIGNMENTS) -> int:
    """The most bytes of buffers the tiles layout holds at once for `tokens` rows (beyond its
    input and output): one chunk's float32 per-assignment rows [chunk x k, hidden], activations
    [chunk x k, intermediate] in the hidden dtype (`element` bytes), the sort by expert and the
    tiles (40 bytes an assignment and 24 a tile, at most one tile per assignment and expert), and
    the chunk's sum over the slots in float32 and in the hidden dtype (copied into the output)."""
    chunk = min(tokens, prefill_chunk_tokens(top_k, chunk_assignments))
    assignments = chunk * top_k
    per_assignment = assignments * hidden_size * 4 + assignments * intermediate * element
    routing = assignments * 40 + 24 * (assignments + 1)
    return per_assignment + routing + chunk * hidden_size * (4 + element)


def fp8_experts_triton_tiles(hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block,
                             chunk_assignments: int = PREFILL_CHUNK_ASSIGNMENTS):
    """The tiles layout of `fp8_experts_triton` (any number of rows; meant for a prefill), a
    chunk of `prefill_chunk_tokens` tokens at a time: each token's output is computed within
    its chunk alone, the same numbers whatever the chunk (`tiles_buffer_bytes` bounds the
    buffers)."""
    _check_kernel_block(block)
    tokens = hidden.shape[0]
    if tokens * top_k_index.shape[1] == 0:
        return torch.zeros_like(hidden)
    chunk = prefill_chunk_tokens(top_k_index.shape[1], chunk_assignments)
    if tokens <= chunk:
        return _tiles_chunk(hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block)
    out = torch.empty_like(hidden)
    for start in range(0, tokens, chunk):
        rows = slice(start, start + chunk)
        out[rows] = _tiles_chunk(hidden[rows], top_k_index[rows], top_k_weights[rows], gate_up, gate_up_scale, down,
                                 down_scale, block)
    return out


def _tiles_chunk(hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block):
    """The tiles layout over every token of its arguments at once."""
    tokens, hidden_size = hidden.shape
    top_k = top_k_index.shape[1]
    num_experts, intermediate = down.shape[0], down.shape[2]
    assignments = tokens * top_k
    block_m = rows_per_tile(assignments, num_experts)
    order, tiles = routing_tiles(top_k_index, num_experts, block_m)
    tile_total = tiles.shape[1]
    sorted_tokens = torch.div(order, top_k, rounding_mode="floor")  # the token of each sorted assignment
    activation = torch.empty(assignments, intermediate, dtype=hidden.dtype, device=hidden.device)
    per_assignment = torch.empty(assignments, hidden_size, dtype=torch.float32, device=hidden.device)
    shared = dict(BLOCK_M=block_m, BLOCK_K=inner_tile(block[1]),
                  DOT_IN_FLOAT32=hidden.dtype == torch.float32 or interpreting())
    _gate_up_kernel[lambda meta: (tile_total, triton.cdiv(intermediate, meta["BLOCK_N"]))](
        hidden.contiguous(), sorted_tokens, tiles, gate_up.contiguous(), gate_up_scale.contiguous(), activation,
        hidden_size, intermediate, tile_total, gate_up_scale.shape[1] // 2, gate_up_scale.shape[2], block[0], block[1],
        **shared,
    )
    _down_kernel[lambda meta: (tile_total, triton.cdiv(hidden_size, meta["BLOCK_N"]))](
        activation, order, top_k_weights.reshape(-1).float().contiguous(), tiles, down.contiguous(),
        down_scale.contiguous(), per_assignment,
        hidden_size, intermediate, tile_total, down_scale.shape[1], down_scale.shape[2], block[0], block[1],
        **shared,
    )
    return per_assignment.view(tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)


# ----------------------------------------------------------------------------- the op


@torch.library.custom_op("drama3::fp8_experts", mutates_args=())
def _fp8_experts_op(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    block_out: int,
    block_in: int,
    experts_per_chunk: int,
) -> torch.Tensor:
    block = (block_out, block_in)
    if kernel_serves(hidden, block):
        return fp8_experts_triton(hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block)
    return fp8_experts_reference(
        hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block, experts_per_chunk
    )


@_fp8_experts_op.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block_out, block_in, experts_per_chunk):
    return torch.empty_like(hidden)


def fp8_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    block: tuple[int, int],
    experts_per_chunk: int = EXPERTS_PER_CHUNK,
) -> torch.Tensor:
    """The routed experts' output `[tokens, H]` (the module docstring) as one op,
    `torch.ops.drama3.fp8_experts`: the kernels for CUDA tensors (`kernel_serves`), the chunked
    reference elsewhere. A gradient wanted through `hidden` or `top_k_weights` runs the reference
    directly (the op has no backward; the FP8 weights themselves are frozen). Shapes and dtypes
    are checked here (`check_inputs`); expert ids are not (that would read them back to the host):
    they must lie in [0, experts)."""
    check_inputs(hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block)
    if torch.is_grad_enabled() and (hidden.requires_grad or top_k_weights.requires_grad):
        return fp8_experts_reference(
            hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block, experts_per_chunk
        )
    return torch.ops.drama3.fp8_experts(
        hidden, top_k_index, top_k_weights, gate_up, gate_up_scale, down, down_scale, block[0], block[1], experts_per_chunk
    )


__all__ = [
    "EXPERTS_PER_CHUNK",
    "check_inputs",
    "fp8_experts",
    "fp8_experts_reference",
    "fp8_experts_triton",
    "fp8_experts_triton_rows",
    "fp8_experts_triton_tiles",
    "kernel_serves",
    "prefill_chunk_tokens",
    "tiles_buffer_bytes",
    "kernel_takes_block",
    "routing_tiles",
    "rows_layout_serves",
    "rows_per_tile",
    "tile_count",
]

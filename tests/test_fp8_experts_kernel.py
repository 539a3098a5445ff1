"""The routed experts kept in block-FP8 (1 byte a weight) and computed from those bytes: the Triton
kernels equal their PyTorch reference (on the CPU through Triton's interpreter), the reference
dequantises one chunk of experts at a time, and `Drama3FP8Experts` computes what the dense model
with the dequantised weights computes, loaded, quantised and saved in the published layout."""

from __future__ import annotations

import json
import math
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from generation_helpers import prompt, reference_greedy
from model_helpers import tiny_model
from transformers import AutoModel
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers_drama3.checkpoint.quantization import (
    FP8_DTYPE,
    Drama3FP8Experts,
    dequantize_block_fp8,
    held_bytes,
    is_routed_expert_weight,
    quantize_block_fp8,
    quantize_block_fp8_power_of_two,
    quantize_experts_fp8,
)
from transformers_drama3.kernels import fp8_expert_gemm as kernel

# Only the tests that run the kernels need Triton (the `interpreted` fixture, `needs_triton`): the
# reference, the routing tiles and the module run everywhere, where Triton is not installed too.
needs_triton = pytest.mark.skipif(not kernel.triton_available(), reason="Triton is not installed (the [gpu] extra)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TEXT = {"moe_intermediate_size": 64}
BLOCK = (32, 32)
PUBLISHED_BLOCK_CONFIG = {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fp8_weights(num_experts: int, hidden: int, intermediate: int, block=BLOCK, seed: int = 0):
    """(gate_up, gate_up_scale, down, down_scale) of random experts, each projection quantised
    alone, blocks scaled by their own factors (so a wrong scale index shows)."""
    g = generator(seed)

    def projection(rows, columns):
        weight = torch.randn(num_experts, rows, columns, generator=g) * 0.2
        grid = (num_experts, math.ceil(rows / block[0]), math.ceil(columns / block[1]))
        factors = 2.0 ** (4 * torch.rand(grid, generator=g) - 2)
        weight = weight * factors.repeat_interleave(block[0], 1)[:, :rows].repeat_interleave(block[1], 2)[:, :, :columns]
        return quantize_block_fp8(weight, block)

    (gate, gate_scale), (up, up_scale) = projection(intermediate, hidden), projection(intermediate, hidden)
    down, down_scale = projection(hidden, intermediate)
    return torch.cat((gate, up), 1), torch.cat((gate_scale, up_scale), 1), down, down_scale


def routing(tokens: int, num_experts: int, top_k: int, seed: int = 0):
    """top_k_index [tokens, k] (distinct experts per token), top_k_weights [tokens, k] in (0.1, 1)."""
    g = generator(seed + 100)
    index = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    return index, 0.1 + 0.9 * torch.rand(tokens, top_k, generator=g)


def on_device(*tensors):
    return [tensor.to(DEVICE) for tensor in tensors]


@pytest.fixture(scope="module")
def interpreted():
    """The kernels run where they can: compiled on CUDA, else in Triton's interpreter on the CPU
    (tests/conftest.py turns it on before triton is imported)."""
    from transformers_drama3.kernels import fused_step

    if not kernel.triton_available():
        pytest.skip("Triton is not installed (the [gpu] extra): the kernels cannot run")
    if not (torch.cuda.is_available() or fused_step.interpreting()):
        pytest.fail("no CUDA and TRITON_INTERPRET is not set: the kernels cannot run (see tests/conftest.py)")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < kernel.FP8_CAPABILITY:
        pytest.skip("this GPU is below compute capability 8.9: Triton has no float8 e4m3 there")
    return kernel.fp8_experts_triton


def assert_float32_close(out, reference):
    """Two float32 paths summing in other orders: a few float32 ulps of the outputs' scale apart
    (an element that cancels to near zero keeps the absolute error of the terms it sums)."""
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))


LAYOUTS = {"rows": kernel.fp8_experts_triton_rows, "tiles": kernel.fp8_experts_triton_tiles}


@pytest.fixture(params=sorted(LAYOUTS))
def layout(request, interpreted):
    """Each layout of the kernels (`fp8_experts_triton` picks one by shape), run where they can."""
    return LAYOUTS[request.param]


def kernel_and_reference(interpreted, hidden, index, weights, experts, block=BLOCK):
    out = interpreted(*on_device(hidden, index, weights, *experts), block).cpu()
    return out, kernel.fp8_experts_reference(hidden, index, weights, *experts, block)


# ----------------------------------------------------------------------------- kernel == reference


@pytest.mark.parametrize("tokens", [1, 5, 64], ids=["decode-1", "decode-5", "decode-64"])
def test_kernel_equals_reference_on_decode_rows(layout, tokens):
    experts = fp8_weights(8, 96, 48)
    hidden = torch.randn(tokens, 96, generator=generator(1))
    out, reference = kernel_and_reference(layout, hidden, *routing(tokens, 8, 2), experts)
    assert_float32_close(out, reference)


def test_kernel_equals_reference_on_a_256_row_prefill_over_8_experts_a_row(interpreted):
    experts = fp8_weights(32, 64, 32)
    hidden = torch.randn(256, 64, generator=generator(2))
    out, reference = kernel_and_reference(interpreted, hidden, *routing(256, 32, 8), experts)
    assert_float32_close(out, reference)


def test_kernel_equals_reference_in_bfloat16(layout):
    experts = fp8_weights(8, 64, 64)
    hidden = torch.randn(20, 64, generator=generator(3)).bfloat16()
    out, reference = kernel_and_reference(layout, hidden, *routing(20, 8, 4), experts)
    assert out.dtype == torch.bfloat16
    # bfloat16 rounds the dequantised weights in the reference, the activations in both: each path
    # is ~0.5% (relative L2) off the float32 result, elements a few bfloat16 ulps of the outputs' scale apart
    out, reference = out.float(), reference.float()
    assert float((out - reference).norm() / reference.norm()) < 1e-2
    torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2 * float(reference.abs().max()))


def test_kernel_equals_reference_with_partial_edge_blocks(layout):
    """Widths that are not whole blocks (72 = 2.25 blocks of 32, 40 = 2.5 of 16 rows), and a gate
    grid whose last block row is partial, so the up grid starts at row ceil(40 / 16) = 3."""
    block = (16, 32)
    experts = fp8_weights(4, 72, 40, block)
    assert experts[1].shape == (4, 6, 3) and experts[3].shape == (4, 5, 2)
    hidden = torch.randn(9, 72, generator=generator(4))
    out, reference = kernel_and_reference(layout, hidden, *routing(9, 4, 2), experts, block)
    assert_float32_close(out, reference)


def test_kernel_equals_reference_when_every_token_picks_the_same_experts(layout):
    """70 rows on two experts: each expert's rows span several tiles (the last one partial), and the
    other experts get none."""
    experts = fp8_weights(8, 64, 32)
    hidden = torch.randn(70, 64, generator=generator(5))
    index = torch.tensor([[5, 2]]).expand(70, 2).contiguous()
    weights = torch.rand(70, 2, generator=generator(6))
    out, reference = kernel_and_reference(layout, hidden, index, weights, experts)
    assert_float32_close(out, reference)


def test_kernel_takes_int32_expert_ids_and_bfloat16_routing_weights(layout):
    experts = fp8_weights(8, 64, 32)
    hidden = torch.randn(4, 64, generator=generator(14))
    index, weights = routing(4, 8, 2)
    out, reference = kernel_and_reference(layout, hidden, index.int(), weights.bfloat16(), experts)
    assert_float32_close(out, reference)


def test_routing_weights_scale_each_slots_contribution(layout):
    """The output is the routing-weighted sum of the slots: each slot alone (the others' weights
    zeroed) sums to the whole, and unit weights give something else (a kernel dropping the weights
    fails here)."""
    experts = fp8_weights(8, 64, 32)
    hidden = torch.randn(6, 64, generator=generator(7))
    index, weights = routing(6, 8, 3)
    whole, _ = kernel_and_reference(layout, hidden, index, weights, experts)
    slots = []
    for slot in range(3):
        alone = torch.zeros_like(weights)
        alone[:, slot] = weights[:, slot]
        slots.append(kernel_and_reference(layout, hidden, index, alone, experts)[0])
    assert_float32_close(sum(slots), whole)
    unweighted, _ = kernel_and_reference(layout, hidden, index, torch.ones_like(weights), experts)
    assert (unweighted - whole).abs().max() > 100 * 1e-5 * whole.abs().max()


def test_the_kernels_dequantise_no_expert(layout, monkeypatch):
    calls = []
    monkeypatch.setattr(kernel, "dequantize_blocks", lambda *args: calls.append(args))
    experts = fp8_weights(8, 64, 32)
    layout(*on_device(torch.randn(16, 64), *routing(16, 8, 2), *experts), BLOCK)
    assert calls == []


@needs_triton
def test_the_kernels_refuse_a_block_whose_inner_width_is_not_a_multiple_of_16():
    experts = fp8_weights(2, 24, 24, (8, 8))
    with pytest.raises(ValueError, match="block_in a multiple of 16"):
        kernel.fp8_experts_triton(torch.randn(2, 24), *routing(2, 2, 1), *experts, (8, 8))


def test_a_decode_step_takes_the_rows_layout_and_a_prefill_the_tiles():
    assert kernel.rows_layout_serves(1 * 8, 256) and kernel.rows_layout_serves(16 * 8, 256)
    assert not kernel.rows_layout_serves(17 * 8, 256) and not kernel.rows_layout_serves(256 * 8, 256)


# ----------------------------------------------------------------------------- routing tiles


def test_routing_tiles_cover_each_assignment_once_with_one_expert_a_tile():
    index, _ = routing(50, 16, 4)
    order, tiles = kernel.routing_tiles(index, 16, 16)
    assert sorted(order.tolist()) == list(range(200))
    flat = index.reshape(-1)
    covered = []
    for expert, start, end in tiles.T.tolist():
        assert end - start <= 16
        covered += list(range(start, end))
        assert all(flat[order[position]] == expert for position in range(start, end))
    assert sorted(covered) == list(range(200))


def test_a_decode_row_over_8_of_256_experts_makes_8_tiles():
    """The grid's size depends on shapes only: its bound is tight for a decode row."""
    index, _ = routing(1, 256, 8)
    block_m = kernel.rows_per_tile(8, 256)
    assert block_m == 16
    _, tiles = kernel.routing_tiles(index, 256, block_m)
    assert tiles.shape == (3, 8)
    assert ((tiles[2] - tiles[1]) == 1).all()


def test_the_kernels_routing_runs_on_the_device_without_a_host_sync():
    """What the kernels' launcher computes with torch (the sort by expert and the tiles) traces as
    one graph with no host sync, data-dependent shape or tensor constant: capturable."""
    from transformers_drama3.kernels.capture_check import check_capturable

    index, _ = routing(5, 16, 4)
    report = check_capturable(lambda top_k_index: kernel.routing_tiles(top_k_index, 16, 16), index)
    assert not report.host_syncs and not report.tensor_constants


# ----------------------------------------------------------------------------- a long prefill, a chunk at a time


def test_a_long_prefill_takes_the_tiles_a_chunk_of_tokens_at_a_time_with_the_same_numbers(interpreted):
    """40 tokens in chunks of 8 (16 assignments of 2 experts): each token's output is the one the
    whole prefill at once gives it, and the reference's."""
    experts = fp8_weights(8, 64, 32)
    hidden = torch.randn(40, 64, generator=generator(21))
    index, weights = routing(40, 8, 2, seed=21)
    arguments = on_device(hidden, index, weights, *experts)
    whole = kernel.fp8_experts_triton_tiles(*arguments, BLOCK).cpu()
    chunked = kernel.fp8_experts_triton_tiles(*arguments, BLOCK, chunk_assignments=16).cpu()
    assert kernel.prefill_chunk_tokens(2, 16) == 8
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6 * float(whole.abs().max()))
    assert_float32_close(chunked, kernel.fp8_experts_reference(hidden, index, weights, *experts, BLOCK))


class AllocationLog(TorchDispatchMode):
    """The bytes of every tensor an op makes (views excluded: they share their base's storage)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.sizes.append(tensor.numel() * tensor.element_size())
        return out


class NoLaunch:
    """A kernel object whose launches do nothing: the launcher's torch work is what is measured."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@needs_triton
def test_the_prefill_buffers_of_the_published_layer_are_bounded_by_one_chunk(monkeypatch):
    """The tiles layout's buffers for the published layer (hidden 2,048, intermediate 512, 256
    experts, 8 a token), measured on the meta device with its launches left out: at most one
    chunk's (`tiles_buffer_bytes`, which the planner counts: 4,096 tokens, 256 MiB of float32
    per-assignment rows), however long the prefill; all at once, 64 x 4,096 rows would take 16 GiB."""
    monkeypatch.setattr(kernel, "_gate_up_kernel", NoLaunch())
    monkeypatch.setattr(kernel, "_down_kernel", NoLaunch())
    hidden_size, intermediate, experts, top_k, block = 2048, 512, 256, 8, (128, 128)

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    weights = (meta(experts, 2 * intermediate, hidden_size, dtype=FP8_DTYPE), meta(experts, 8, 16, dtype=torch.float32),
               meta(experts, hidden_size, intermediate, dtype=FP8_DTYPE), meta(experts, 16, 4, dtype=torch.float32))

    def buffers(tokens: int, **chunking) -> AllocationLog:
        inputs = (meta(tokens, hidden_size), meta(tokens, top_k, dtype=torch.long), meta(tokens, top_k, dtype=torch.float32))
        with AllocationLog() as log:
            kernel.fp8_experts_triton_tiles(*inputs, *weights, block, **chunking)
        return log

    chunk = kernel.prefill_chunk_tokens(top_k)
    per_assignment = chunk * top_k * hidden_size * 4
    assert chunk == 4096 and per_assignment == 256 * 2**20
    one = buffers(chunk)
    output = chunk * hidden_size * 2
    planned = kernel.tiles_buffer_bytes(chunk, top_k, hidden_size, intermediate, 2)
    # every tensor the chunk makes but its output, as if none were freed: the planner's bytes hold it, tightly
    assert sum(one.sizes) - output <= planned <= 1.1 * (sum(one.sizes) - output)
    three = buffers(3 * chunk)
    assert max(three.sizes) == per_assignment
    assert kernel.tiles_buffer_bytes(3 * chunk, top_k, hidden_size, intermediate, 2) == planned
    # all at once (no chunking), the per-assignment rows grow with the prefill
    assert max(buffers(3 * chunk, chunk_assignments=10**9).sizes) == 3 * per_assignment


# ----------------------------------------------------------------------------- the reference


def test_chunked_reference_equals_the_unchunked_one():
    experts = fp8_weights(32, 64, 32)
    hidden = torch.randn(40, 64, generator=generator(8))
    index, weights = routing(40, 32, 8)
    chunked = kernel.fp8_experts_reference(hidden, index, weights, *experts, BLOCK, experts_per_chunk=3)
    whole = kernel.fp8_experts_reference(hidden, index, weights, *experts, BLOCK, experts_per_chunk=32)
    assert torch.equal(chunked, whole)


class DenseExpertsAlive:
    """Wraps the reference's dequantiser: counts the dense expert matrices alive at once."""

    def __init__(self):
        self.alive = self.peak = 0
        self.experts = set()

    def wrap(self, dequantize):
        def counted(weight, scale_inv, block, dtype):
            dense = dequantize(weight, scale_inv, block, dtype)
            self.alive += dense.shape[0]
            self.peak = max(self.peak, self.alive)
            weakref.finalize(dense, self.release, dense.shape[0])
            return dense

        return counted

    def release(self, count: int) -> None:
        self.alive -= count


@pytest.mark.parametrize("chunk", [kernel.EXPERTS_PER_CHUNK, 32], ids=["chunked", "whole-layer"])
def test_a_256_row_prefill_dequantises_one_chunk_of_experts_at_a_time(monkeypatch, chunk):
    """256 rows x 8 experts each touch all 32 experts; the dense copies alive at once are one chunk's
    gate, up and down matrices (the whole-layer run shows the count sees every copy)."""
    counter = DenseExpertsAlive()
    monkeypatch.setattr(kernel, "dequantize_blocks", counter.wrap(kernel.dequantize_blocks))
    experts = fp8_weights(32, 64, 32)
    index, weights = routing(256, 32, 8)
    kernel.fp8_experts_reference(torch.randn(256, 64), index, weights, *experts, BLOCK, experts_per_chunk=chunk)
    assert counter.peak == 3 * chunk
    assert counter.alive == 0


def test_reference_computes_what_transformers_dense_experts_compute_with_the_dequantised_weights():
    config = Qwen3_5MoeTextConfig(hidden_size=96, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
    gate_up, gate_up_scale, down, down_scale = fp8_weights(8, 96, 48)
    dense = Qwen3_5MoeExperts(config)
    rows = gate_up_scale.shape[1] // 2
    with torch.no_grad():
        dense.gate_up_proj.copy_(torch.cat((
            dequantize_block_fp8(gate_up[:, :48], gate_up_scale[:, :rows], BLOCK, torch.float32),
            dequantize_block_fp8(gate_up[:, 48:], gate_up_scale[:, rows:], BLOCK, torch.float32),
        ), 1))
        dense.down_proj.copy_(dequantize_block_fp8(down, down_scale, BLOCK, torch.float32))
    hidden = torch.randn(11, 96, generator=generator(9))
    index, weights = routing(11, 8, 2)
    reference = kernel.fp8_experts_reference(hidden, index, weights, gate_up, gate_up_scale, down, down_scale, BLOCK)
    torch.testing.assert_close(reference, dense(hidden, index, weights).detach(), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_with_the_input_named():
    experts = fp8_weights(4, 64, 32)
    index, weights = routing(3, 4, 2)
    with pytest.raises(ValueError, match="top_k_weights"):
        kernel.fp8_experts(torch.randn(3, 64), index, weights[:, :1], *experts, BLOCK)
    with pytest.raises(ValueError, match="gate_up_scale"):
        kernel.fp8_experts(torch.randn(3, 64), index, weights, experts[0], experts[1][:, :1], *experts[2:], BLOCK)
    with pytest.raises(ValueError, match="gate_up"):
        kernel.fp8_experts(torch.randn(3, 48), index, weights, *experts, BLOCK)


# ----------------------------------------------------------------------------- one op


def test_the_ops_fake_implementation_passes_torch_librarys_check():
    experts = fp8_weights(4, 64, 32)
    index, weights = routing(5, 4, 2)
    torch.library.opcheck(
        torch.ops.drama3.fp8_experts.default, (torch.randn(5, 64), index, weights, *experts, *BLOCK, 8),
        test_utils=("test_faketensor",),
    )


def test_a_moe_layer_with_fp8_experts_is_capturable():
    """The router, the shared expert and the FP8 experts as one op: no break, constant or host sync."""
    from transformers_drama3.kernels.capture_check import check_capturable

    model = tiny_model(0, text=TEXT)
    quantize_experts_fp8(model, BLOCK)
    with torch.no_grad():
        report = check_capturable(model.backbone.layers[0].mlp, torch.randn(1, 3, 64))
    assert report.op_counts["drama3.fp8_experts.default"] == 1


def test_compiled_with_fullgraph_the_layer_is_one_opaque_op():
    model = tiny_model(0, text=TEXT)
    quantize_experts_fp8(model, BLOCK)
    experts = model.backbone.layers[0].mlp.experts
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    hidden = torch.randn(7, 64, generator=generator(10))
    index, weights = routing(7, 4, 2)
    with torch.no_grad():
        compiled = torch.compile(experts, backend=recording, fullgraph=True)(hidden, index, weights)
        eager = experts(hidden, index, weights)
    torch._dynamo.reset()
    assert len(graphs) == 1
    calls = [getattr(node.target, "overloadpacket", node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert calls == [torch.ops.drama3.fp8_experts]
    torch.testing.assert_close(compiled, eager)


# ----------------------------------------------------------------------------- the module


def test_quantized_experts_hold_one_byte_a_weight_plus_block_scales():
    model = tiny_model(0, text=TEXT)
    assert quantize_experts_fp8(model, BLOCK) == model.config.text_config.num_hidden_layers
    experts = model.backbone.layers[0].mlp.experts
    assert isinstance(experts, Drama3FP8Experts)
    num_experts, hidden, intermediate = 4, 64, 64
    scales = num_experts * (2 * 2 * 2 + 2 * 2)  # gate and up grids [2, 2] each, down [2, 2]
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8_DTYPE
    held = held_bytes(model)
    prefix = "model.language_model.layers.0.mlp.experts."
    assert held[prefix + "gate_up_proj"] + held[prefix + "down_proj"] == num_experts * 3 * intermediate * hidden
    assert held[prefix + "gate_up_proj_scale_inv"] + held[prefix + "down_proj_scale_inv"] == 4 * scales
    assert model.config.published_quantization_config == PUBLISHED_BLOCK_CONFIG


def test_module_computes_the_dense_experts_with_its_dequantised_weights():
    model = tiny_model(0, text=TEXT)
    dense = model.backbone.layers[1].mlp.experts
    quantize_experts_fp8(model, BLOCK)
    fp8 = model.backbone.layers[1].mlp.experts
    rows = fp8.gate_up_proj_scale_inv.shape[1] // 2
    with torch.no_grad():
        gate = dequantize_block_fp8(fp8.gate_up_proj[:, :64], fp8.gate_up_proj_scale_inv[:, :rows], BLOCK, torch.float32)
        up = dequantize_block_fp8(fp8.gate_up_proj[:, 64:], fp8.gate_up_proj_scale_inv[:, rows:], BLOCK, torch.float32)
        # the quantised weights are within e4m3 rounding of the dense ones ...
        assert ((torch.cat((gate, up), 1) - dense.gate_up_proj).abs() <= dense.gate_up_proj.abs() / 16 + 1e-6).all()
        dense.gate_up_proj.copy_(torch.cat((gate, up), 1))
        dense.down_proj.copy_(dequantize_block_fp8(fp8.down_proj, fp8.down_proj_scale_inv, BLOCK, torch.float32))
        hidden = torch.randn(13, 64, generator=generator(11))
        index, weights = routing(13, 4, 2)
        # ... and the module computes exactly what the dense experts compute with them
        torch.testing.assert_close(fp8(hidden, index, weights), dense(hidden, index, weights), rtol=1e-5, atol=1e-5)


def test_module_kernel_path_equals_its_reference_path_in_the_whole_model(interpreted, monkeypatch):
    model = tiny_model(0, text=TEXT).to(DEVICE)
    quantize_experts_fp8(model, BLOCK)
    ids, codes = on_device(*prompt(0))
    with torch.no_grad():
        monkeypatch.setattr(kernel, "kernel_serves", lambda hidden, block: False)
        reference = model(ids[None], codes[None]).logits
        monkeypatch.setattr(kernel, "kernel_serves", lambda hidden, block: True)
        through_kernel = model(ids[None], codes[None]).logits
    torch.testing.assert_close(through_kernel, reference, rtol=1e-5, atol=1e-5)


def test_casting_the_model_keeps_the_fp8_bytes_and_float32_scales():
    model = tiny_model(0, text=TEXT)
    quantize_experts_fp8(model, BLOCK)
    experts = model.backbone.layers[0].mlp.experts
    codes, scales = experts.gate_up_proj.clone(), experts.gate_up_proj_scale_inv.clone()
    model.to(torch.bfloat16)
    assert model.backbone.embed_tokens.weight.dtype == torch.bfloat16
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.gate_up_proj_scale_inv.dtype == torch.float32
    assert torch.equal(experts.gate_up_proj.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(experts.gate_up_proj_scale_inv, scales)


def test_gradients_reach_the_hidden_states_through_the_reference():
    model = tiny_model(0, text=TEXT)
    dense = model.backbone.layers[0].mlp.experts
    quantize_experts_fp8(model, BLOCK)
    fp8 = model.backbone.layers[0].mlp.experts
    rows = fp8.gate_up_proj_scale_inv.shape[1] // 2
    with torch.no_grad():
        dense.gate_up_proj.copy_(torch.cat((
            dequantize_block_fp8(fp8.gate_up_proj[:, :64], fp8.gate_up_proj_scale_inv[:, :rows], BLOCK, torch.float32),
            dequantize_block_fp8(fp8.gate_up_proj[:, 64:], fp8.gate_up_proj_scale_inv[:, rows:], BLOCK, torch.float32),
        ), 1))
        dense.down_proj.copy_(dequantize_block_fp8(fp8.down_proj, fp8.down_proj_scale_inv, BLOCK, torch.float32))
    index, weights = routing(5, 4, 2)
    gradients = []
    for experts in (fp8, dense):
        hidden = torch.randn(5, 64, generator=generator(12)).requires_grad_()
        experts(hidden, index, weights).square().sum().backward()
        gradients.append(hidden.grad)
    torch.testing.assert_close(*gradients, rtol=1e-5, atol=1e-5)
    assert not fp8.gate_up_proj.requires_grad


# ----------------------------------------------------------------------------- checkpoints


def write_fp8_checkpoint(directory, power_of_two: bool = False):
    """A tiny published-layout checkpoint with block-FP8 experts (blocks of BLOCK): the amax rule,
    or scales rounded up to powers of two (which quantising the dequantised weights afresh would
    not reproduce)."""
    model = tiny_model(0, text=TEXT)
    model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = PUBLISHED_BLOCK_CONFIG
    (directory / "config.json").write_text(json.dumps(config))
    quantizer = quantize_block_fp8_power_of_two if power_of_two else quantize_block_fp8
    tensors = {}
    for name, tensor in load_file(directory / "model.safetensors").items():
        if is_routed_expert_weight(name):
            tensors[name], tensors[name + "_scale_inv"] = quantizer(tensor, BLOCK)
        else:
            tensors[name] = tensor
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return tensors


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fp8_checkpoint")
    write_fp8_checkpoint(directory)
    return directory


def load_as_on_an_fp8_gpu(directory, monkeypatch, **kwargs):
    """`from_pretrained` as transformers does it on a GPU with FP8 kernels (compute capability
    >= 8.9): its environment check, the one place it decides to dequantise, is skipped, so it builds
    `FP8Experts` and reads the FP8 bytes into them; the package's loader then swaps them."""
    with monkeypatch.context() as patch:
        patch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *args, **kw: None)
        return AutoModel.from_pretrained(directory, dtype=torch.float32, output_loading_info=True, **kwargs)


def stored_bytes(tensors):
    return {name: (tensor.dtype, tensor.contiguous().view(torch.uint8).numpy().tobytes()) for name, tensor in tensors.items()}


def test_a_block_fp8_checkpoint_kept_in_fp8_loads_into_the_module(fp8_checkpoint, monkeypatch):
    model, info = load_as_on_an_fp8_gpu(fp8_checkpoint, monkeypatch)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stored = load_file(fp8_checkpoint / "model.safetensors")
    for layer in model.backbone.layers:
        experts = layer.mlp.experts
        assert type(experts) is Drama3FP8Experts and experts.block == BLOCK
    experts = model.backbone.layers[2].mlp.experts
    prefix = "model.language_model.layers.2.mlp.experts.3."
    assert torch.equal(experts.down_proj[3].view(torch.uint8), stored[prefix + "down_proj.weight"].view(torch.uint8))
    assert torch.equal(experts.gate_up_proj_scale_inv[3, 2:], stored[prefix + "up_proj.weight_scale_inv"])


def test_the_module_gives_the_dequantised_loads_logits_and_greedy_frames(fp8_checkpoint, monkeypatch):
    fp8, _ = load_as_on_an_fp8_gpu(fp8_checkpoint, monkeypatch)
    dense = AutoModel.from_pretrained(fp8_checkpoint, dtype=torch.float32)
    assert type(dense.backbone.layers[0].mlp.experts) is not Drama3FP8Experts
    ids, codes = prompt(1)
    with torch.no_grad():
        torch.testing.assert_close(fp8(ids[None], codes[None]).logits, dense(ids[None], codes[None]).logits,
                                   rtol=1e-5, atol=1e-5)
        frames, _ = reference_greedy(fp8, ids, codes, 4)
        expected, _ = reference_greedy(dense, ids, codes, 4)
    assert torch.equal(frames, expected)


def test_a_model_loaded_in_fp8_saves_the_checkpoints_bytes(fp8_checkpoint, monkeypatch, tmp_path):
    model, _ = load_as_on_an_fp8_gpu(fp8_checkpoint, monkeypatch)
    assert model.save_pretrained(tmp_path) == []
    assert stored_bytes(load_file(tmp_path / "model.safetensors")) == stored_bytes(load_file(fp8_checkpoint / "model.safetensors"))
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] == PUBLISHED_BLOCK_CONFIG


def test_quantizing_a_dequantised_load_gives_back_the_checkpoints_own_bytes(tmp_path):
    """Power-of-two scales: the kept checkpoint bytes come back, not a fresh amax quantisation;
    the record stops keeping them (the module holds them)."""
    stored = write_fp8_checkpoint(tmp_path / "published", power_of_two=True)
    model = AutoModel.from_pretrained(tmp_path / "published", dtype=torch.float32)
    assert model.loaded_checkpoint.kept_bytes > 0
    quantize_experts_fp8(model, BLOCK)
    assert model.loaded_checkpoint.kept_bytes == 0
    assert model.save_pretrained(tmp_path / "saved") == []
    assert stored_bytes(load_file(tmp_path / "saved" / "model.safetensors")) == stored_bytes(stored)


def test_a_quantized_dense_model_saves_the_published_layout_and_loads_back(tmp_path):
    model = tiny_model(0, text=TEXT)
    quantize_experts_fp8(model, BLOCK)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    name = "model.language_model.layers.0.mlp.experts.1.gate_proj.weight"
    assert saved[name].dtype == FP8_DTYPE and saved[name + "_scale_inv"].shape == (2, 2)
    loaded = AutoModel.from_pretrained(tmp_path, dtype=torch.float32)
    ids, codes = prompt(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids[None], codes[None]).logits, model(ids[None], codes[None]).logits,
                                   rtol=1e-5, atol=1e-5)


def test_quantizing_with_another_block_than_the_checkpoints_is_refused(fp8_checkpoint):
    model = AutoModel.from_pretrained(fp8_checkpoint, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"block_size=\(128, 128\).*pass block_size=\(32, 32\)"):
        quantize_experts_fp8(model, (128, 128))
    assert type(model.backbone.layers[0].mlp.experts) is not Drama3FP8Experts


# ----------------------------------------------------------------------------- on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
def test_on_cuda_the_kernels_equal_the_reference_at_the_published_width(layout, tokens):
    block = (128, 128)
    experts = [tensor.cuda() for tensor in fp8_weights(64, 2048, 512, block)]
    hidden = torch.randn(tokens, 2048, generator=generator(13)).bfloat16().cuda()
    index, weights = on_device(*routing(tokens, 64, 8))
    out = layout(hidden, index, weights, *experts, block)
    reference = kernel.fp8_experts_reference(hidden.float(), index, weights, *experts, block)
    assert float((out.float() - reference).norm() / reference.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4], ids=["rows-layout", "tiles-layout"])
def test_on_cuda_a_decode_call_captures_in_a_cuda_graph(interpreted, tokens):
    model = tiny_model(0, text=TEXT).cuda()
    quantize_experts_fp8(model, BLOCK)
    experts = model.backbone.layers[0].mlp.experts
    hidden = torch.randn(tokens, 64, device="cuda")
    index, weights = on_device(*routing(tokens, 4, 2))
    with torch.no_grad():
        for _ in range(2):  # autotuning and first launches outside the capture
            experts(hidden, index, weights)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = experts(hidden, index, weights)
        new_index, new_weights = on_device(*routing(tokens, 4, 2, seed=5))
        hidden.copy_(torch.randn(tokens, 64, device="cuda"))
        index.copy_(new_index)
        weights.copy_(new_weights)
        graph.replay()
        torch.testing.assert_close(captured, experts(hidden, index, weights))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_from_pretrained_keeps_the_experts_in_fp8_in_the_module(fp8_checkpoint):
    model = AutoModel.from_pretrained(fp8_checkpoint, dtype=torch.bfloat16, device_map="cuda")
    experts = model.backbone.layers[0].mlp.experts
    if experts.gate_up_proj.dtype != FP8_DTYPE:
        pytest.skip("this GPU is below compute capability 8.9: transformers dequantised the experts")
    assert type(experts) is Drama3FP8Experts and experts.gate_up_proj.is_cuda
    dense = AutoModel.from_pretrained(fp8_checkpoint, dtype=torch.float32)
    ids, codes = prompt(3)
    with torch.no_grad():
        logits = model(ids[None].cuda(), codes[None].cuda()).logits.float().cpu()
        reference = dense(ids[None], codes[None]).logits
    assert float((logits - reference).norm() / reference.norm()) < 2e-2

"""Every CUDA branch of every device router, traced on a CPU (issue 61).

With flash-linear-attention installed (the suite binds it even without CUDA), each routed function
of transformers' Qwen3.5-MoE modeling is traced with `torch.compile(fullgraph=True)` on meta tensors
standing in for CUDA ones (`cuda_stand_in`): what a GPU's compiled prefill or decode step would
call. Nothing a CUDA branch calls inside a compiled region may be `torch.compiler.disable`d (fla's
`chunk_gated_delta_rule` is: the compiled prefill holds it as the op `drama3::chunk_gated_delta_rule`)
or otherwise stop the trace."""

import re
from pathlib import Path

import pytest
import torch

from transformers_drama3.integrations import qwen3_5_moe
from transformers_drama3.kernels import chunk_delta_rule
from transformers_drama3.kernels.capture_check import capture_report
from transformers_drama3.kernels.cuda_paths import cuda_stand_in, takes_cuda_path

pytest.importorskip("fla")

META = torch.device("meta")
BATCH, ROWS, HEADS, V_HEADS, K_DIM, V_DIM, CHANNELS, WIDTH = 2, 20, 2, 4, 16, 16, 32, 4


def delta_inputs(rows, batch=BATCH, device=META, dtype=torch.float32):
    """query, key [batch, rows, heads, k_dim]; value [batch, rows, v_heads, v_dim]; g, beta [batch, rows, v_heads]."""
    generator = torch.Generator().manual_seed(rows)
    shapes = [(batch, rows, HEADS, K_DIM)] * 2 + [(batch, rows, V_HEADS, V_DIM)] + [(batch, rows, V_HEADS)] * 2
    tensors = [torch.randn(shape, generator=generator) for shape in shapes]
    tensors[3] = torch.nn.functional.logsigmoid(tensors[3])  # g: a log decay, float32 as transformers passes it
    tensors[4] = tensors[4].sigmoid()
    return [tensor.to(device=device, dtype=dtype if index < 3 else torch.float32) for index, tensor in enumerate(tensors)]


def state(batch=BATCH):
    return torch.zeros(batch, V_HEADS, K_DIM, V_DIM, device=META)


CASES = {
    # name: (routed function, args, kwargs, op the branch must put in the graph, or None: PyTorch ops only)
    "chunked delta rule (a prefill)": lambda: (
        "torch_chunk_gated_delta_rule", delta_inputs(ROWS),
        dict(initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=None, use_cache=True),
        "drama3.chunk_gated_delta_rule.default"),
    "chunked delta rule from a state (an extend)": lambda: (
        "torch_chunk_gated_delta_rule", delta_inputs(ROWS),
        dict(initial_state=state(), output_final_state=True, use_qk_l2norm_in_kernel=True), "drama3.chunk_gated_delta_rule.default"),
    "recurrent delta rule, a decode row": lambda: (
        "torch_recurrent_gated_delta_rule", delta_inputs(1),
        dict(initial_state=state(), output_final_state=True, use_qk_l2norm_in_kernel=True), "drama3.gated_delta_rule_decode.default"),
    "recurrent delta rule, several rows": lambda: (
        "torch_recurrent_gated_delta_rule", delta_inputs(3),
        dict(initial_state=state(), output_final_state=True, use_qk_l2norm_in_kernel=True), None),
    "causal conv (a prefill)": lambda: (
        "causal_conv1d_fn", [torch.randn(BATCH, CHANNELS, ROWS, device=META), torch.randn(CHANNELS, WIDTH, device=META)],
        dict(bias=None, activation="silu"), None),
    "causal conv update, a decode row": lambda: (
        "causal_conv1d_update",
        [torch.randn(BATCH, CHANNELS, 1, device=META), torch.randn(BATCH, CHANNELS, WIDTH - 1, device=META),
         torch.randn(CHANNELS, WIDTH, device=META)],
        dict(bias=None, activation="silu"), "drama3.short_conv_update.default"),
    "causal conv update, several rows": lambda: (
        "causal_conv1d_update",
        [torch.randn(BATCH, CHANNELS, 2, device=META), torch.randn(BATCH, CHANNELS, WIDTH - 1, device=META),
         torch.randn(CHANNELS, WIDTH, device=META)],
        dict(bias=None, activation="silu"), None),
}


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_every_cuda_branch_of_every_router_traces_as_one_graph(case):
    name, args, kwargs, op = CASES[case]()
    routed = getattr(qwen3_5_moe, name)

    def call(*args, **kwargs):
        return routed(*args, **kwargs)

    torch._dynamo.reset()
    with cuda_stand_in("meta"):
        report = capture_report(call, *args, **kwargs)
    assert report.graph_breaks == [] and report.graphs == 1 and report.device == "meta"
    assert report.host_syncs == [] and report.tensor_constants == [] and report.cpu_tensors == []
    custom = {name for name in report.op_counts if not name.startswith("aten.")}
    assert custom == ({op} if op else set())


@torch.no_grad()
def test_packed_documents_on_the_cuda_path_of_a_compiled_region_are_named_not_traced_wrong():
    """Packed documents are a training input (no compiled path of the package passes them): the
    chunked rule's varlen op is named a host sync (fla reads the offsets on the host), and the
    recurrent rule refuses them inside a compiled region (its reference would mix the documents)."""
    offsets = torch.tensor([0, 7, 2 * ROWS], device=META)
    flat = delta_inputs(ROWS)
    with cuda_stand_in("meta"):
        report = capture_report(lambda *a, **k: qwen3_5_moe.torch_chunk_gated_delta_rule(*a, **k), *flat,
                                output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=offsets)
        assert [finding.what for finding in report.host_syncs] == ["drama3.chunk_gated_delta_rule_varlen.default"]
        torch._dynamo.reset()
        one_row = [tensor[:1] for tensor in delta_inputs(1)]
        compiled = torch.compile(lambda *a, **k: qwen3_5_moe.torch_recurrent_gated_delta_rule(*a, **k), fullgraph=True, backend="eager")
        with pytest.raises(Exception, match="packed documents"):
            compiled(*one_row, initial_state=state(1), output_final_state=True, cu_seqlens=torch.tensor([0, 1], device=META))


# ---- the chunked rule's op ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("output_final_state", [True, False])
def test_the_chunk_op_hands_the_bound_kernel_its_arguments_and_returns_its_outputs(monkeypatch, dtype, output_final_state):
    """The op calls the kernel the router bound (here transformers' PyTorch reference, on the CPU)
    with the arguments it was given: the same output and final state as calling it directly, the
    final state None when none was asked for. Its fake implementation (what a compiled graph plans
    memory by) gives the reference's shapes and dtypes."""
    reference = qwen3_5_moe.torch_chunk_gated_delta_rule.drama3_reference
    monkeypatch.setattr(chunk_delta_rule, "_BOUND", [reference])
    inputs = delta_inputs(ROWS, device=torch.device("cpu"), dtype=dtype)
    initial = torch.randn(BATCH, V_HEADS, K_DIM, V_DIM)
    options = dict(initial_state=initial, output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)
    expected_out, expected_state = reference(*inputs, **options)
    out, final = chunk_delta_rule.chunk_gated_delta_rule(*inputs, **options)
    assert torch.equal(out, expected_out)
    assert (final is None) == (not output_final_state)
    if output_final_state:
        assert torch.equal(final, expected_state)
    fake_out, fake_state = torch.ops.drama3.chunk_gated_delta_rule(
        *(tensor.to(META) for tensor in inputs), initial.to(META), output_final_state, True)
    assert (fake_out.shape, fake_out.dtype) == (expected_out.shape, expected_out.dtype)
    if output_final_state:
        assert (fake_state.shape, fake_state.dtype) == (expected_state.shape, expected_state.dtype)


def test_the_chunk_op_serves_compiled_inference_only():
    query = torch.zeros(1, 2, 1, 1, requires_grad=True)
    assert not chunk_delta_rule.serves_compiled(query, {})  # eager: fla is called directly
    with torch.no_grad():
        assert not chunk_delta_rule.serves_compiled(query, {})


# ---- the stand-in ----------------------------------------------------------------------------------------


def test_a_stand_in_takes_the_cuda_paths_only_inside_and_only_for_a_device_that_computes_nothing():
    meta = torch.zeros(1, device=META)
    assert not takes_cuda_path(meta) and not takes_cuda_path(torch.zeros(1))
    with pytest.raises(RuntimeError, match="planted"), cuda_stand_in("meta"):
        assert takes_cuda_path(meta) and takes_cuda_path(META) and not takes_cuda_path(torch.zeros(1))
        raise RuntimeError("planted")
    assert not takes_cuda_path(meta)
    with pytest.raises(ValueError, match="'cpu' cannot stand in for CUDA"):
        with cuda_stand_in("cpu"):
            pass


HOST_SIDE_CUDA_CHECKS = {
    "kernels/cuda_paths.py": "the predicate itself",
    "kernels/device_dispatch.py": "`_cuda_callee`: which of two CUDA-path callees, once the path is taken",
    "kernels/fused_step.py": "`use_kernel`: eager calls only (False inside a compiled region, whatever the device)",
    "kernels/fp8_expert_gemm.py": "`kernel_serves`: read inside the op's own implementation when it runs, never traced",
    "decoding/loop.py": "`runs_ahead` and `PendingStep`: the host's loop (queuing ahead, pinned copies)",
    "decoding/request.py": "the default compile config: chosen on the host before anything runs",
    "serving/engine.py": "`_settle`: the scheduler waits for the device on the host, to time a prefill",
    "layers/offloaded_experts.py": "the expert offload's pinned host store (offloaded experts are never compiled)",
    "checkpoint/quantization/quantized_loading.py": "loading",
    "checkpoint/quantization/weights.py": "loading",
    "runtime/loading.py": "loading",
}
"""The files that may branch on a real CUDA device without `takes_cuda_path`, and why: nothing there
decides what a compiled region traces."""


def test_every_branch_on_cuda_that_a_trace_takes_asks_the_one_predicate():
    """A new `.is_cuda` / `device.type == "cuda"` outside `HOST_SIDE_CUDA_CHECKS` would be a CUDA
    branch the stand-in cannot force: the traces above would not see what it calls."""
    package = Path(__file__).parents[1] / "src" / "transformers_drama3"
    pattern = re.compile(r"\.is_cuda\b|\.type\s*[!=]=\s*[\"']cuda[\"']|device_type\s*[!=]=\s*[\"']cuda[\"']")
    found = {str(path.relative_to(package)) for path in package.rglob("*.py")
             if any(pattern.search(line) and not line.lstrip().startswith("#") for line in path.read_text().splitlines())}
    assert found - set(HOST_SIDE_CUDA_CHECKS) == set(), (
        "a CUDA check outside the listed host-side files: ask kernels.cuda_paths.takes_cuda_path if it "
        "decides what a compiled region traces, else list the file in HOST_SIDE_CUDA_CHECKS with why")
    assert set(HOST_SIDE_CUDA_CHECKS) - found == set()  # the list names no file that no longer checks

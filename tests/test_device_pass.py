"""The GPU path checked on a CPU (issue 61): what the compiled decode step, the engine's step over its
pool and the compiled prefill trace when their tensors are on a GPU.

Each is built by the package's own code on a stand-in device (`meta`, every CUDA branch of the
package taken: `kernels.cuda_paths.cuda_stand_in`) and, where torch is a CUDA build, traced again
on FakeTensors on "cuda" (transformers' and torch's own CUDA branches taken too). The capture check
then runs the graph under a dispatch mode that names every operator touching a CPU tensor: a
counter left on the CPU, a constant the trace made there. Inductor skips CUDA graphs for a graph
with any ("skipping cudagraphs due to cpu device"), as it does for an input written in place
without a static address."""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from transformers import CompileConfig

from device_pass_helpers import (
    EAGER_GRAPHS, FAKE_CUDA_REASON, META, FakeCuda, fake_cuda_available, meta_model, meta_run, stand_in,
)
from generation_helpers import prompt, tiny_model
from transformers_drama3.decoding import step as decode_step
from transformers_drama3.decoding.loop import DecodeRun, _prefill_rows, capturable_experts, left_padded
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.decoding.state import DecodeCache, linear_layer_counters
from transformers_drama3.kernels.capture_check import capture_report
from transformers_drama3.kernels.cuda_paths import cuda_stand_in
from transformers_drama3.serving.engine import Drama3Engine, RequestHandle, SpeechJob

KINDS = [
    pytest.param("meta", id="meta"),
    pytest.param("fake-cuda", id="fake-cuda", marks=pytest.mark.skipif(not fake_cuda_available(), reason=FAKE_CUDA_REASON)),
]


def assert_capturable_on(report, device_type):
    assert report.graphs == 1 and report.ops > 0 and report.device == device_type
    assert report.problems() == []


def off_device(cache: DecodeCache, device_type: str) -> dict:
    return {name: tensor.device for name, tensor in cache.tensors().items() if tensor.device.type != device_type}


def unmarked(cache: DecodeCache) -> list[str]:
    return [name for name, tensor in cache.tensors().items() if getattr(tensor, "_dynamo_static_input_type", None) is None]


# ---- every tensor of a cache is on the states' device ---------------------------------------------


@pytest.fixture(scope="module")
def model():
    return meta_model()


@pytest.fixture(scope="module")
def run(model):
    torch._dynamo.reset()
    return meta_run(model)


def test_a_new_cache_holds_its_counters_on_its_device(model):
    """transformers' Gated DeltaNet layer makes its token counter on the CPU; the cache's layers hold
    it on the cache's device before anything writes it (a compiled prefill writes it in place)."""
    cache = DecodeCache(model, 256, META, 2)
    counters = [name for name in cache.tensors() if name.endswith("cumulative_length_linear")]
    linear = sum(layer_type == "linear_attention" for layer_type in model.config.text_config.layer_types)
    assert len(counters) == linear
    assert off_device(cache, "meta") == {}


def test_the_engine_pool_and_its_views_hold_every_tensor_on_the_states_device_marked_static(run):
    """`pool_like` and `head` build the Gated DeltaNet layers by hand (`_linear_layer`): their counters
    are on the states' device, marked static with the rest, and a view shares the pool's counters
    (the same address for every view of the pool)."""
    pool = DecodeCache.pool_like(run.cache, 4, 256)
    assert off_device(pool, "meta") == {}
    pool.mark_static()
    assert unmarked(pool) == []
    view = pool.head(2)
    assert off_device(view, "meta") == {} and unmarked(view) == []
    for mine, theirs in zip(view.backbone.layers, pool.backbone.layers):
        if hasattr(mine, "conv_states"):
            assert all(linear_layer_counters(mine)[name] is counter for name, counter in linear_layer_counters(theirs).items())


def test_a_compiled_run_holds_its_states_and_counters_on_its_device_marked_static(run):
    assert off_device(run.cache, "meta") == {}
    assert unmarked(run.cache) == []


@torch.no_grad()
def test_the_compiled_prefill_leaves_no_state_and_no_counter_in_its_graph_outputs(model):
    """What a compiled prefill returns lives in CUDA-graph memory the next replay reuses: after it,
    every tensor the cache holds, the Gated DeltaNet counters included, is a copy of its own
    (`own_states`), no storage shared with an output of the graph."""
    outputs = []

    def recording(gm, example_inputs):
        def run_graph(*args):
            result = gm(*args)
            outputs.extend(value for value in torch.utils._pytree.tree_leaves(result) if isinstance(value, torch.Tensor))
            return result
        return run_graph

    torch._dynamo.reset()
    compiled = meta_run(model, compile_config=CompileConfig(fullgraph=True, dynamic=False, backend=recording, mode=None))
    assert outputs
    graph_storages = {StorageWeakRef(tensor.untyped_storage()) for tensor in outputs}
    shared = [name for name, tensor in compiled.cache.tensors().items() if StorageWeakRef(tensor.untyped_storage()) in graph_storages]
    assert shared == []


# ---- the engine's compiled step over its pool (CPU) ------------------------------------------------


@torch.no_grad()
def test_the_engine_step_over_its_pool_passes_every_capture_guard():
    """`drama3 serve --compile` steps a view of the engine's pool: one graph, no break, constant or
    host sync, and every input it writes in place (the Gated DeltaNet counters included) marked
    static. The step's arguments are the engine's own, taken at its first compiled step."""
    model = tiny_model(seed=0)
    engine = Drama3Engine(model, max_batch=4, compile_config=EAGER_GRAPHS)
    stepped = []
    engine._compiled = lambda function, *args: stepped.append(args) or function(*args)
    for seed in (1, 2, 3):
        ids, codes = prompt(seed)
        engine.submit(SpeechJob(ids[None], codes[None], SamplingSettings(), seed=seed, max_new_tokens=8))
    while len(stepped) < 2:  # the second step: all three requests in the batch
        engine.step()
    args = stepped[-1]
    assert args[1].backbone_part.next_column.shape[0] == 4  # 3 requests in a bucket of 4 items
    with capturable_experts(model):
        assert_capturable_on(capture_report(decode_step.step, *args), "cpu")


# ---- the traces on a stand-in device -----------------------------------------------------------------


def on(kind, *values):
    """`values` as a trace of `kind` takes them: the meta objects themselves, or fake CUDA copies."""
    if kind == "meta":
        return values
    fake = FakeCuda()
    return tuple(fake.module(value) if isinstance(value, torch.nn.Module) else fake.copy(value) for value in values)


def expected_device(kind) -> str:
    return "meta" if kind == "meta" else "cuda"


@pytest.fixture
def fresh_model(kind, model):
    """The module's meta model for meta traces; its own for a fake CUDA copy (made in place)."""
    return model if kind == "meta" else meta_model()


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_the_decode_step_touches_no_cpu_tensor_on_the_gpu_path(kind, fresh_model, monkeypatch):
    """The compiled decode step of a prefilled run (seeded top-k with RAS), traced with every tensor on
    the stand-in device: one capturable graph, no operator on a CPU tensor, and the backbone's
    decode-row ops in it (the CUDA branches were taken)."""
    torch._dynamo.reset()
    prefilled = meta_run(fresh_model)
    for part in prefilled.cache.parts:
        prefilled.cache.open_window(part, 1)
    model, cache, sampler, state = on(kind, fresh_model, prefilled.cache, prefilled.sampler, prefilled.state)
    if kind == "fake-cuda":
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100 / H200
    with stand_in(kind), capturable_experts(model):
        report = capture_report(decode_step.step, model, cache, sampler, state, None)
    assert_capturable_on(report, expected_device(kind))
    linear = sum(layer_type == "linear_attention" for layer_type in model.config.text_config.layer_types)
    assert report.op_counts["drama3.short_conv_update.default"] == linear
    assert report.op_counts["drama3.gated_delta_rule_decode.default"] == linear


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_the_engine_step_over_its_pool_touches_no_cpu_tensor_on_the_gpu_path(kind, fresh_model, monkeypatch):
    """Three requests joined by the engine's own code (`_join`: its pool, the view of the running
    items, the batch's state and sampler) on the stand-in device, each prefilled by the compiled
    prefill; each resolved request's RAS window (computed from its prompt on the host, as on a GPU)
    moved to the device as its prompt would be. The step over the view: one
    capturable graph, no operator on a CPU tensor."""
    import dataclasses

    torch._dynamo.reset()
    engine = Drama3Engine(fresh_model, max_batch=4, compile_config=EAGER_GRAPHS)
    for number, seed in enumerate((1, 2, 3)):
        ids, codes = prompt(seed)
        handle = RequestHandle(number, SpeechJob(ids[None], codes[None], SamplingSettings(), seed=seed, max_new_tokens=8), seed)
        slot = engine._new_slot(handle)
        # the resolved request's RAS window on the device, as its prompt is (the engine moves its budgets
        # and draws its keys from its seeds when it joins)
        slot = dataclasses.replace(slot, request=dataclasses.replace(slot.request, window=slot.request.window.to(META)))
        with cuda_stand_in("meta"):
            run = DecodeRun.prefilled(fresh_model, ids[None].to(META), codes[None].to(META),
                                      torch.ones(1, ids.shape[0], dtype=torch.long, device=META), None,
                                      torch.zeros(1, dtype=torch.long), compile_config=EAGER_GRAPHS, prefill_graphs=True)
            engine._join(run, slot)
    longest = max(slot.rows for slot in engine._slots)
    view = engine._open_view(longest, longest - 1)
    assert view.backbone_part.next_column.shape[0] == 4
    model, view, sampler, state = on(kind, fresh_model, view, engine._sampler, engine._state)
    if kind == "fake-cuda":
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with stand_in(kind), capturable_experts(model):
        report = capture_report(decode_step.step, model, view, sampler, state, engine.separator_id)
    assert_capturable_on(report, expected_device(kind))


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_the_compiled_prefill_holds_the_chunked_kernel_as_one_op_on_the_gpu_path(kind, fresh_model, monkeypatch):
    """With flash-linear-attention installed, a CUDA prefill's Gated DeltaNet layers reach fla's
    `chunk_gated_delta_rule`, which is `torch.compiler.disable`d (a fullgraph trace raised "Skip
    calling torch.compiler.disable()d function"): the compiled prefill holds it as the op
    `drama3::chunk_gated_delta_rule`, one per layer, and touches no CPU tensor."""
    pytest.importorskip("fla")
    from transformers_drama3.integrations import kernel_report

    assert kernel_report()["torch_chunk_gated_delta_rule"].startswith("fla.")
    ids, codes, mask = left_padded(*(tensor[None] for tensor in prompt(1, text_rows=3)), None, 16)
    cache = DecodeCache(fresh_model, 256, META, 1)
    cache.open_window(cache.backbone_part, 16)
    cache.open_window(cache.tower_part, 15)
    cache.mark_counters_static()
    model, cache, ids, codes, mask = on(kind, fresh_model, cache, ids.to(META), codes.to(META), mask.to(META))
    if kind == "fake-cuda":
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    torch._dynamo.reset()
    with stand_in(kind), capturable_experts(model):
        report = capture_report(_prefill_rows, model, ids, codes, mask, cache)
    assert_capturable_on(report, expected_device(kind))
    linear = sum(layer_type == "linear_attention" for layer_type in model.config.text_config.layer_types)
    assert report.op_counts["drama3.chunk_gated_delta_rule.default"] == linear

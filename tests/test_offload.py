"""Expert offload: routed experts in host memory, an LRU cache of them on the compute device, the
same outputs as the resident model (forward, greedy generate, the engine), counters that add up."""

from __future__ import annotations

import copy

import pytest
import torch

from generation_helpers import prompt, tiny_model
from transformers_drama3 import expert_cache_stats, offload_experts
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.layers.offloaded_experts import ExpertCacheStats, OffloadedExperts
from transformers_drama3.serving.engine import DoneEvent, Drama3Engine, SpeechJob

FLOAT32 = dict(rtol=1e-5, atol=1e-5)
EXPERTS = 4  # tiny_model: 4 routed experts a layer, 2 per token, 4 layers
LAYERS = 4


@pytest.fixture(scope="module")
def resident():
    return tiny_model(seed=0)


def offloaded(model, cache_experts: int, device="cpu"):
    return offload_experts(copy.deepcopy(model), cache_experts=cache_experts, device=device)


def forward(model, seed: int = 0):
    ids, codes = prompt(seed)
    with torch.no_grad():
        return model(input_ids=ids[None], audio_codes=codes[None])


# 3: a layer choosing all 4 experts computes [0, 1, 2] then [3] with 1 and 2 still resident
@pytest.mark.parametrize("cache_experts", [EXPERTS, 3, 2, 1])
def test_forward_equals_the_resident_model(resident, cache_experts):
    model = offloaded(resident, cache_experts)

    expected, got = forward(resident), forward(model)

    torch.testing.assert_close(got.logits, expected.logits, **FLOAT32)
    torch.testing.assert_close(got.codebook_logits, expected.codebook_logits, **FLOAT32)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, **FLOAT32)


@pytest.mark.parametrize("cache_experts", [EXPERTS, 1])
def test_greedy_generate_gives_the_resident_models_codes(resident, cache_experts):
    model = offloaded(resident, cache_experts)
    ids, codes = prompt(3)

    expected = resident.generate(ids[None], codes[None], do_sample=False, max_new_tokens=6, return_dict_in_generate=True)
    got = model.generate(ids[None], codes[None], do_sample=False, max_new_tokens=6, return_dict_in_generate=True)

    assert torch.equal(got.lengths, expected.lengths)
    assert torch.equal(got.audio_codes, expected.audio_codes)


def test_the_engine_gives_the_resident_models_codes(resident):
    model = offloaded(resident, 2)
    jobs = [SpeechJob(ids[None], codes[None], SamplingSettings(do_sample=False), seed=seed, max_new_tokens=6)
            for seed, (ids, codes) in enumerate([prompt(4), prompt(5, text_rows=8)])]

    def run(on):
        engine = Drama3Engine(on, max_batch=2)
        handles = [engine.submit(job) for job in jobs]
        while not engine.idle:
            engine.step()
        return [handle.result(timeout=1) for handle in handles]

    for got, expected in zip(run(model), run(resident)):
        assert isinstance(got, DoneEvent) and isinstance(expected, DoneEvent)
        assert torch.equal(got.codes, expected.codes)


def test_every_layers_experts_are_replaced_and_the_rest_is_unchanged(resident):
    model = offloaded(resident, 2)

    layers = [module for module in model.modules() if isinstance(module, OffloadedExperts)]
    assert len(layers) == LAYERS
    # the state dict keeps the published names and values (save_pretrained writes the same files)
    expected = resident.state_dict()
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_host_store_and_cache_are_separate_tensors(resident):
    model = offloaded(resident, 2)
    layer = next(module for module in model.modules() if isinstance(module, OffloadedExperts))

    for name in ("gate_up_proj", "down_proj"):
        host, cache = getattr(layer, name), getattr(layer.compute, name)
        assert host.device.type == "cpu" and host.shape[0] == EXPERTS
        assert cache.shape == (2, *host.shape[1:])
        assert host.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()
    # the cache is not a weight of the model
    assert all(tensor.shape[0] == EXPERTS for name, tensor in model.named_parameters() if "mlp.experts" in name)


def test_a_second_identical_forward_only_hits(resident):
    model = offloaded(resident, EXPERTS)
    forward(model)
    first = expert_cache_stats(model)

    forward(model)
    second = expert_cache_stats(model)

    assert first.misses > 0 and first.misses == first.copies and first.evictions == 0
    assert second.misses == first.misses and second.copies == first.copies  # nothing copied again
    assert second.hits - first.hits == first.hits + first.misses  # every chosen expert was resident


def test_a_cache_smaller_than_the_chosen_experts_evicts_and_still_matches(resident):
    model = offloaded(resident, 1)

    torch.testing.assert_close(forward(model, seed=1).logits, forward(resident, seed=1).logits, **FLOAT32)
    stats = expert_cache_stats(model)

    assert stats.evictions > 0
    assert stats.copies == stats.misses
    # a one-slot cache holds one expert a layer: every miss after each layer's first evicts one
    assert stats.evictions == stats.misses - LAYERS
    layer = next(module for module in model.modules() if isinstance(module, OffloadedExperts))
    assert stats.copied_bytes == stats.copies * layer.expert_bytes
    assert layer.expert_bytes == 3 * 32 * 64 * 4  # gate, up, down of [32, 64] in float32


def test_counters_add_up_per_layer_and_step(resident):
    model = offloaded(resident, EXPERTS)
    ids, codes = prompt(2)
    with torch.no_grad():
        chosen = []
        hooks = [layer.register_forward_pre_hook(lambda module, args: chosen.append(args[1].unique().numel()))
                 for layer in model.modules() if isinstance(layer, OffloadedExperts)]
        model(input_ids=ids[None], audio_codes=codes[None])
        for hook in hooks:
            hook.remove()

    stats = expert_cache_stats(model)

    assert stats.hits + stats.misses == sum(chosen)
    assert stats.misses == sum(chosen)  # a cold cache: each layer's chosen experts are all copied once


def test_cache_of_zero_or_fewer_experts_is_refused(resident):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"cache_experts={bad!r}: expected a whole number of experts per layer"):
            offloaded(resident, bad)


def test_a_cache_above_the_expert_count_is_clamped_with_a_warning(resident):
    with pytest.warns(UserWarning, match=rf"cache_experts=9 is more than the {EXPERTS} routed experts of a layer"):
        model = offloaded(resident, 9)

    assert {module.capacity for module in model.modules() if isinstance(module, OffloadedExperts)} == {EXPERTS}
    torch.testing.assert_close(forward(model).logits, forward(resident).logits, **FLOAT32)


def test_offloading_twice_is_refused(resident):
    model = offloaded(resident, 2)

    with pytest.raises(ValueError, match="already offloaded"):
        offload_experts(model, cache_experts=2, device="cpu")


def test_experts_that_are_not_fused_float_tensors_are_refused(resident):
    model = copy.deepcopy(resident)
    experts = model.model.language_model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.data.to(torch.int8), requires_grad=False)

    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts .* without fused float gate_up_proj"):
        offload_experts(model, cache_experts=2, device="cpu")


def test_a_model_dispatched_over_several_devices_is_refused(resident):
    model = copy.deepcopy(resident)
    model.hf_device_map = {"model.language_model": 0, "audio_decoder_mtp": "cpu"}

    with pytest.raises(ValueError, match="loaded with a device_map over .* load it without device_map"):
        offload_experts(model, cache_experts=2, device="cpu")


def test_model_to_leaves_the_experts_in_host_memory(resident):
    model = offloaded(resident, 2)
    layer = next(module for module in model.modules() if isinstance(module, OffloadedExperts))
    before = layer.gate_up_proj.untyped_storage().data_ptr()

    model.to("cpu")

    assert layer.gate_up_proj.untyped_storage().data_ptr() == before


def test_a_compiled_step_is_refused_naming_the_offload(resident):
    from transformers import CompileConfig

    model = offloaded(resident, 2)
    ids, codes = prompt(5)

    with pytest.raises(Exception, match="the routed experts are offloaded"):
        model.generate(ids[None], codes[None], do_sample=False, max_new_tokens=2, cache_implementation="static",
                       compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="eager"))


def test_a_static_cache_without_compiling_gives_the_resident_models_codes(resident):
    model = offloaded(resident, 1)
    ids, codes = prompt(5)

    expected = resident.generate(ids[None], codes[None], do_sample=False, max_new_tokens=6, return_dict_in_generate=True)
    got = model.generate(ids[None], codes[None], do_sample=False, max_new_tokens=6, cache_implementation="static",
                         disable_compile=True, return_dict_in_generate=True)

    assert torch.equal(got.audio_codes, expected.audio_codes)


def test_stats_add():
    total = ExpertCacheStats(1, 2, 3, 4, 5) + ExpertCacheStats(10, 20, 30, 40, 50)
    assert total == ExpertCacheStats(11, 22, 33, 44, 55)


# ----------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_host_store_is_pinned_and_the_cache_on_the_gpu(resident):
    model = offloaded(resident, 2, device="cuda")
    layer = next(module for module in model.modules() if isinstance(module, OffloadedExperts))

    assert layer.gate_up_proj.is_pinned() and layer.down_proj.is_pinned()
    assert layer.compute.gate_up_proj.device.type == "cuda"
    assert model.lm_head.weight.device.type == "cuda"


@cuda
@pytest.mark.parametrize("cache_experts", [EXPERTS, 1])
def test_cuda_offloaded_forward_and_generate_equal_the_resident_model_on_cuda(resident, cache_experts):
    on_gpu = copy.deepcopy(resident).to("cuda")
    model = offloaded(resident, cache_experts, device="cuda")
    ids, codes = prompt(3)
    ids, codes = ids.cuda(), codes.cuda()

    with torch.no_grad():
        expected = on_gpu(input_ids=ids[None], audio_codes=codes[None]).logits
        got = model(input_ids=ids[None], audio_codes=codes[None]).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # TF32 / kernel order on the GPU

    expected = on_gpu.generate(ids[None], codes[None], do_sample=False, max_new_tokens=6, return_dict_in_generate=True)
    got = model.generate(ids[None], codes[None], do_sample=False, max_new_tokens=6, return_dict_in_generate=True)
    assert torch.equal(got.audio_codes, expected.audio_codes)


def test_the_least_recently_used_expert_is_the_one_evicted(resident):
    """A known access sequence through one layer's cache of 2: after [0, 1], then [0] (0 is now the
    most recently used), a miss on 2 evicts 1, the least recently used; then [3] evicts 0. Each slot
    holds the weights of the expert the cache says it holds."""
    experts = copy.deepcopy(resident.backbone.layers[0].mlp.experts)
    layer = OffloadedExperts(experts, capacity=2, device=torch.device("cpu"))
    hidden = torch.randn(1, experts.gate_up_proj.shape[-1])

    def access(*chosen):
        index = torch.tensor([list(chosen)])
        with torch.no_grad():
            layer(hidden.expand(1, -1), index, torch.full(index.shape, 1.0 / len(chosen)))
        return list(layer.resident)  # least recently used first

    assert access(0, 1) == [0, 1]
    assert access(0) == [1, 0]
    assert access(2) == [0, 2]  # 1 left, not 0 (the most recently used)
    assert access(3) == [2, 3]
    assert (layer.stats.hits, layer.stats.misses, layer.stats.evictions) == (1, 4, 2)
    for expert, slot in layer.resident.items():
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(layer.compute, name)[slot], getattr(layer, name)[expert])

"""LoRA adapters served per request: each batch item speaks with its own adapter (or the base model),
its codes those it has served alone with that adapter and those of the PEFT-merged model; adapters
that do not fit the model are refused before they are registered; slots are capped (LRU)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from generation_helpers import prompt, tiny_model
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.serving.adapter_layers import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE, AdapterError, base_fingerprint, read_adapter, routed,
)
from transformers_drama3.serving.adapters import AdapterRegistry, AdapterSlotsBusy, parse_adapter_spec
from transformers_drama3.serving.engine import DoneEvent, Drama3Engine, SpeechJob
from peft import get_peft_model

from transformers_drama3.training.lora import lora_config

MAX_FRAMES = 8
FLOAT32 = dict(rtol=1.3e-6, atol=1e-5)


def base_model(dtype=torch.float64):
    model = tiny_model(seed=0)
    model.set_experts_implementation("eager")  # the grouped-GEMM experts take no float64
    return model.to(dtype)


def trained_adapter(base, folder, seed: int, rank: int = 4, scale: float = 0.3, use_rslora: bool = False):
    """A PEFT "light" adapter with non-trivial weights (LoRA factors and the full-trained heads and
    codebook table moved off the base), saved to `folder` with the base's fingerprint; returns the
    PEFT model (on a copy of `base`). `use_rslora`: B is scaled by alpha / sqrt(r) (rsLoRA)."""
    config = lora_config(base, "light", r=rank)
    config.use_rslora = use_rslora
    peft = get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in peft.named_parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale)
    peft.save_pretrained(folder)
    (folder / BASE_FILE).write_text(json.dumps(base_fingerprint(base.config)))
    return peft


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A float64 base model with adapter slots, two registered adapters and their merged models."""
    root = tmp_path_factory.mktemp("adapters")
    model = base_model()
    merged = {}
    for name, seed in (("alto", 1), ("bass", 2)):
        peft = trained_adapter(model, root / name, seed)
        merged[name] = peft.merge_and_unload().eval()
    reference = copy.deepcopy(model)
    registry = AdapterRegistry(model, max_loaded=3, max_rank=8)
    for name in merged:
        registry.register(name, root / name)
    return model, reference, registry, merged, root


def job(seed: int, prompt_seed: int, adapter=None, **settings) -> SpeechJob:
    ids, codes = prompt(seed=prompt_seed)
    sampling = SamplingSettings(**settings) if settings else SamplingSettings(temperature=1.1, top_p=0.95)
    return SpeechJob(ids[None], codes[None], sampling, seed=seed, max_new_tokens=MAX_FRAMES, adapter=adapter)


def drive(engine, arrivals: dict):
    handles, step = [], 0
    while step <= max(arrivals) or not engine.idle:
        handles += [engine.submit(j) for j in arrivals.get(step, [])]
        engine.step()
        step += 1
    return handles


def generate_codes(model, request: SpeechJob):
    settings = request.settings
    out = model.generate(
        request.input_ids, request.audio_codes, seed=request.seed, max_new_tokens=request.max_new_tokens,
        do_sample=settings.do_sample, temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
        return_dict_in_generate=True,
    )
    return out.audio_codes[0, : int(out.lengths[0])]


# ---- the layers ---------------------------------------------------------------------------------


def test_installing_slots_changes_no_output_and_slot_zero_is_the_base(served):
    model, reference, *_ = served
    ids, codes = prompt(seed=5)
    expected = reference(input_ids=ids[None], audio_codes=codes[None]).logits
    torch.testing.assert_close(model(input_ids=ids[None], audio_codes=codes[None]).logits, expected)
    with routed(torch.tensor([0])):
        torch.testing.assert_close(model(input_ids=ids[None], audio_codes=codes[None]).logits, expected)


def test_an_adapter_in_its_slot_computes_the_merged_models_logits_and_hidden_states(served):
    model, reference, registry, merged, _ = served
    ids, codes = prompt(seed=6)
    base = reference(input_ids=ids[None], audio_codes=codes[None], output_hidden_states=True)
    for name, merged_model in merged.items():
        expected = merged_model(input_ids=ids[None], audio_codes=codes[None], output_hidden_states=True)
        with registry.use(name):
            got = model(input_ids=ids[None], audio_codes=codes[None], output_hidden_states=True)
        assert not torch.allclose(got.logits, base.logits, **FLOAT32), "the adapter must change the output"
        torch.testing.assert_close(got.logits.float(), expected.logits.float(), **FLOAT32)
        for mine, theirs in zip(got.hidden_states, expected.hidden_states, strict=True):
            torch.testing.assert_close(mine.float(), theirs.float(), **FLOAT32)


def test_a_mixed_batch_forward_gives_each_item_its_adapters_logits(served):
    model, reference, registry, merged, _ = served
    prompts = [prompt(seed=7), prompt(seed=7), prompt(seed=7)]
    ids = torch.stack([p[0] for p in prompts])
    codes = torch.stack([p[1] for p in prompts])
    names = [None, "alto", "bass"]
    leases = [registry.acquire(name) for name in names[1:]]
    try:
        with routed(torch.tensor([0] + [lease.slot for lease in leases])):
            got = model(input_ids=ids, audio_codes=codes).logits
    finally:
        for lease in leases:
            lease.release()
    for item, name in enumerate(names):
        alone = (reference if name is None else merged[name])(input_ids=ids[item : item + 1], audio_codes=codes[item : item + 1])
        torch.testing.assert_close(got[item : item + 1].float(), alone.logits.float(), **FLOAT32)


def test_generate_with_an_adapter_speaks_the_merged_models_codes(served):
    model, reference, registry, merged, _ = served
    request = job(seed=4, prompt_seed=8)
    with registry.use("alto"):
        codes = generate_codes(model, request)
    assert torch.equal(codes, generate_codes(merged["alto"], request))
    assert not torch.equal(codes, generate_codes(reference, request))


def test_an_rslora_adapter_in_its_slot_computes_the_merged_models_logits_and_codes(tmp_path):
    """rsLoRA scales B by alpha / sqrt(r), not alpha / r: at r=4 and alpha=8 one is twice the other,
    so a slot that ignored `use_rslora` would miss the merged model's logits and codes."""
    model = base_model()
    reference = copy.deepcopy(model)
    merged = trained_adapter(reference, tmp_path / "rs", seed=3, use_rslora=True).merge_and_unload().eval()
    config = json.loads((tmp_path / "rs" / ADAPTER_CONFIG).read_text())
    assert config["use_rslora"] is True and config["lora_alpha"] == 2 * config["r"] == 8
    registry = AdapterRegistry(model, max_loaded=1, max_rank=4)
    registry.register("rs", tmp_path / "rs")
    ids, codes = prompt(seed=10)
    with registry.use("rs"):
        got = model(input_ids=ids[None], audio_codes=codes[None]).logits
    expected = merged(input_ids=ids[None], audio_codes=codes[None]).logits
    torch.testing.assert_close(got.float(), expected.float(), **FLOAT32)
    request = job(seed=5, prompt_seed=11)
    with registry.use("rs"):
        spoken = generate_codes(model, request)
    assert torch.equal(spoken, generate_codes(merged, request))
    assert not torch.equal(spoken, generate_codes(reference, request))


# ---- the engine ---------------------------------------------------------------------------------


def test_a_mixed_batch_gives_each_request_its_codes_alone_and_the_merged_models(served):
    model, reference, registry, merged, _ = served
    requests = [
        job(seed=11, prompt_seed=21, adapter="alto"),
        job(seed=12, prompt_seed=22),
        job(seed=13, prompt_seed=23, adapter="bass"),
        job(seed=14, prompt_seed=21, adapter="bass", do_sample=False),
        job(seed=11, prompt_seed=21),  # the first request on the base model
    ]
    engine = Drama3Engine(model, max_batch=8, adapters=registry)
    handles = drive(engine, {0: requests[:3], 2: requests[3:]})
    results = [handle.result(timeout=1) for handle in handles]
    assert all(isinstance(result, DoneEvent) for result in results)
    for request, result in zip(requests, results):
        (alone,) = drive(Drama3Engine(model, max_batch=8, adapters=registry), {0: [request]})
        assert torch.equal(result.codes, alone.result(timeout=1).codes), f"seed {request.seed} {request.adapter}"
        expected = generate_codes(reference if request.adapter is None else merged[request.adapter], request)
        assert torch.equal(result.codes, expected), f"seed {request.seed} {request.adapter}"
    assert not torch.equal(results[0].codes, results[4].codes), "the adapter must change the take"
    assert all(entry.leases == 0 for entry in registry._entries.values())


def test_the_prefix_cache_keeps_an_adapters_prefix_apart_from_the_bases(served):
    from transformers_drama3.serving.prefix_cache import PrefixCache

    model, reference, registry, merged, _ = served
    cache = PrefixCache()
    engine = Drama3Engine(model, max_batch=4, prefill=cache.prefill, adapters=registry)
    plain = job(seed=31, prompt_seed=24)
    plain.prefix = "voice"
    adapted = job(seed=31, prompt_seed=24, adapter="alto")
    adapted.prefix = "voice"
    first, second = drive(engine, {0: [plain], 3: [adapted]})
    assert torch.equal(first.result(timeout=1).codes, generate_codes(reference, plain))
    assert torch.equal(second.result(timeout=1).codes, generate_codes(merged["alto"], adapted))


def test_a_compiled_engine_routes_each_bucket_item_to_its_adapter(served):
    """The slot layers hold no branch on a tensor: dynamo takes draw and feed whole (fullgraph; its
    eager backend runs the graph) with three requests, two adapters and the base, in a bucket of 4."""
    from transformers import CompileConfig

    _, reference, _, merged, root = served
    traced = base_model()
    traced.set_experts_implementation("batched_mm")  # the eager experts loop over the chosen experts
    registry = AdapterRegistry(traced, max_loaded=2, max_rank=8)
    for name in merged:
        registry.register(name, root / name)
    requests = [job(seed=41, prompt_seed=25, adapter="bass"), job(seed=42, prompt_seed=26), job(seed=43, prompt_seed=27, adapter="alto")]
    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)
    engine = Drama3Engine(traced, max_batch=4, adapters=registry, compile_config=config)
    handles = drive(engine, {0: requests})
    for request, handle in zip(requests, handles):
        result = handle.result(timeout=1)
        assert isinstance(result, DoneEvent), result
        expected = generate_codes(reference if request.adapter is None else merged[request.adapter], request)
        assert torch.equal(result.codes, expected), f"seed {request.seed} {request.adapter}"


def test_an_unknown_adapter_is_refused_at_submit_and_nothing_is_queued(served):
    model, _, registry, *_ = served
    engine = Drama3Engine(model, max_batch=2, adapters=registry)
    with pytest.raises(KeyError):
        engine.submit(job(seed=1, prompt_seed=1, adapter="tenor"))
    assert engine.idle
    with pytest.raises(ValueError, match="serves no adapters"):
        Drama3Engine(model, max_batch=2).submit(job(seed=1, prompt_seed=1, adapter="alto"))


def test_an_adapter_deleted_while_a_request_uses_it_finishes_that_request_first(served, tmp_path):
    model, reference, registry, merged, root = served
    registry.register("alto-2", root / "alto")
    engine = Drama3Engine(model, max_batch=2, adapters=registry)
    request = job(seed=52, prompt_seed=28, adapter="alto-2")
    handle = engine.submit(request)
    engine.step()
    engine.step()
    registry.delete("alto-2")
    assert "alto-2" not in registry
    with pytest.raises(KeyError):
        engine.submit(job(seed=1, prompt_seed=1, adapter="alto-2"))
    slot = handle.lease.slot
    assert slot not in registry._free, "the slot stays while its request runs"
    while not engine.idle:
        engine.step()
    assert torch.equal(handle.result(timeout=1).codes, generate_codes(merged["alto"], request))
    assert slot in registry._free


# ---- limits -------------------------------------------------------------------------------------


def test_the_least_recently_used_idle_adapter_gives_up_its_slot_and_reloads_on_demand(tmp_path):
    model = base_model()
    reference = copy.deepcopy(model)
    registry = AdapterRegistry(model, max_loaded=2, max_rank=4)
    merged = {}
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        merged[name] = trained_adapter(reference, tmp_path / name, seed).merge_and_unload()
        registry.register(name, tmp_path / name)
    assert registry.loaded() == ["b", "c"]  # "a" was the least recently used when "c" came
    held = registry.acquire("b")
    registry.acquire("a").release()  # loads "a" into "c"'s slot: "b" is held
    assert registry.loaded() == ["a", "b"]
    other = registry.acquire("a")
    with pytest.raises(AdapterSlotsBusy, match="adapter slots"):
        registry.acquire("c")  # both slots serve requests
    held.release(), other.release()
    ids, codes = prompt(seed=9)
    with registry.use("c"):
        got = model(input_ids=ids[None], audio_codes=codes[None]).logits
    torch.testing.assert_close(got, merged["c"](input_ids=ids[None], audio_codes=codes[None]).logits, **FLOAT32)


@pytest.fixture
def small_registry():
    model = base_model(torch.float32)
    return model, AdapterRegistry(model, max_loaded=2, max_rank=4)


def refused(registry, name, folder, match):
    before = (registry.names(), registry.loaded(), [layer.lora_A.clone() for layer in registry.slots.lora.values()])
    with pytest.raises(AdapterError, match=match):
        registry.register(name, folder)
    after = (registry.names(), registry.loaded(), [layer.lora_A for layer in registry.slots.lora.values()])
    assert before[:2] == after[:2]
    assert all(torch.equal(x, y) for x, y in zip(before[2], after[2]))


def test_an_adapter_of_another_base_model_is_refused_naming_what_differs(small_registry, tmp_path):
    model, registry = small_registry
    trained_adapter(model, tmp_path / "x", seed=1)
    fingerprint = json.loads((tmp_path / "x" / BASE_FILE).read_text())
    fingerprint["text_config.num_hidden_layers"] += 1
    (tmp_path / "x" / BASE_FILE).write_text(json.dumps(fingerprint))
    refused(registry, "x", tmp_path / "x", r"different base model \(text_config.num_hidden_layers: adapter 5, served model 4")


def test_an_adapter_whose_shapes_differ_is_refused_naming_the_module(small_registry, tmp_path):
    model, registry = small_registry
    from model_helpers import tiny_text_config

    wider = tiny_model(seed=0, text=tiny_text_config(shared_expert_intermediate_size=48)).float()
    trained_adapter(wider, tmp_path / "w", seed=1)
    (tmp_path / "w" / BASE_FILE).unlink()  # no fingerprint: the shapes still tell
    refused(registry, "w", tmp_path / "w", r"shared_expert\.\w+_proj has lora_A .* the served model needs")


def test_an_adapter_above_the_servers_rank_is_refused_naming_the_rank(small_registry, tmp_path):
    model, registry = small_registry
    trained_adapter(model, tmp_path / "r", seed=1, rank=8)
    refused(registry, "r", tmp_path / "r", r"rank 8 is above the server's largest rank 4")


def test_an_adapter_on_modules_the_model_lacks_is_refused_naming_them(small_registry, tmp_path):
    from safetensors.torch import load_file, save_file

    model, registry = small_registry
    trained_adapter(model, tmp_path / "m", seed=1)
    tensors = load_file(tmp_path / "m" / ADAPTER_WEIGHTS)
    tensors["base_model.model.model.language_model.layers.9.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
    save_file(tensors, tmp_path / "m" / ADAPTER_WEIGHTS)
    refused(registry, "m", tmp_path / "m", r"LoRA on 'model.language_model.layers.9.self_attn.q_proj', a module the served model does not have")


def test_a_heavy_preset_adapter_is_refused_naming_the_expert_parameters(small_registry, tmp_path):
    model, registry = small_registry
    trained_adapter(model, tmp_path / "h", seed=1)
    config = json.loads((tmp_path / "h" / ADAPTER_CONFIG).read_text())
    config["target_parameters"] = ["mlp.experts.gate_up_proj"]
    (tmp_path / "h" / ADAPTER_CONFIG).write_text(json.dumps(config))
    refused(registry, "h", tmp_path / "h", r"target_parameters=.*routed experts")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "config", "missing"])
def test_a_corrupt_adapter_file_is_refused_without_touching_the_registry(small_registry, tmp_path, damage):
    model, registry = small_registry
    trained_adapter(model, tmp_path / "ok", seed=1)
    registry.register("ok", tmp_path / "ok")
    folder = tmp_path / "bad"
    trained_adapter(model, folder, seed=2)
    weights = folder / ADAPTER_WEIGHTS
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbage":
        weights.write_bytes(b"\x00" * 64)
    elif damage == "config":
        (folder / ADAPTER_CONFIG).write_text("{not json")
    else:
        weights.unlink()
    match = {"truncated": "cannot be read", "garbage": "cannot be read", "config": "adapter_config.json: not JSON", "missing": "no adapter_model"}
    refused(registry, "bad", folder, match[damage])
    assert registry.names() == ["ok"]


def test_a_nan_in_an_adapter_is_refused_naming_the_tensor(small_registry, tmp_path):
    from safetensors.torch import load_file, save_file

    model, registry = small_registry
    trained_adapter(model, tmp_path / "n", seed=1)
    tensors = load_file(tmp_path / "n" / ADAPTER_WEIGHTS)
    key = next(iter(tensors))
    tensors[key][0] = float("nan")
    save_file(tensors, tmp_path / "n" / ADAPTER_WEIGHTS)
    refused(registry, "n", tmp_path / "n", "NaN or infinite")


def test_a_server_path_outside_the_allowed_root_is_refused(tmp_path):
    model = base_model(torch.float32)
    trained_adapter(model, tmp_path / "inside" / "v", seed=1)
    trained_adapter(model, tmp_path / "outside", seed=2)
    registry = AdapterRegistry(model, max_loaded=1, max_rank=4, allowed_root=tmp_path / "inside")
    with pytest.raises(PermissionError, match="outside"):
        registry.register_path("o", "../outside")
    with pytest.raises(PermissionError, match="outside"):
        registry.register_path("o", str(tmp_path / "outside"))
    registry.register_path("v", "v")
    assert registry.names() == ["v"]
    closed = AdapterRegistry(base_model(torch.float32), max_loaded=1, max_rank=4)
    with pytest.raises(PermissionError, match="--adapter-root"):
        closed.register_path("v", str(tmp_path / "inside" / "v"))


def test_an_upload_is_checked_before_it_is_stored_and_its_folder_goes_with_it(tmp_path):
    model = base_model(torch.float32)
    trained_adapter(model, tmp_path / "src", seed=1)
    storage = tmp_path / "store"
    registry = AdapterRegistry(model, max_loaded=1, max_rank=4, storage=storage)
    files = {name: (tmp_path / "src" / name).read_bytes() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}
    with pytest.raises(AdapterError, match="cannot be read"):
        registry.register_upload("me", {**files, ADAPTER_WEIGHTS: files[ADAPTER_WEIGHTS][:100]})
    assert list(storage.iterdir()) == [] and registry.names() == []
    registry.register_upload("me", files)
    assert (storage / "me" / ADAPTER_WEIGHTS).read_bytes() == files[ADAPTER_WEIGHTS]
    restarted = AdapterRegistry(base_model(torch.float32), max_loaded=1, max_rank=4, storage=storage)
    assert restarted.register_stored() == [] and restarted.names() == ["me"]
    registry.delete("me")
    assert not (storage / "me").exists()


def test_the_adapter_flag_reads_name_equals_path():
    assert parse_adapter_spec("me=out/adapter") == ("me", "out/adapter")
    for bad in ("me", "=out", "me=", "bad name=out"):
        with pytest.raises(ValueError):
            parse_adapter_spec(bad)


def test_reading_an_adapter_writes_nothing(tmp_path):
    model = base_model(torch.float32)
    trained_adapter(model, tmp_path / "a", seed=1)
    before = sorted(p.name for p in (tmp_path / "a").iterdir())
    weights = read_adapter(tmp_path / "a", model, max_rank=4, name="a")
    assert weights.rank == 4 and weights.lora and weights.full
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == before


def test_drama3_serve_refuses_bad_adapter_flags_before_loading(tmp_path):
    from transformers_drama3.cli import check_adapter_flags
    from transformers_drama3.runtime.command_line import build_parser
    from transformers_drama3.runtime.loading import CommandError

    def flags(*argv):
        return build_parser().parse_args(["serve", *argv])

    check_adapter_flags(flags("--adapter", f"me={tmp_path}", "--adapter-root", str(tmp_path)))
    for argv, message in (
        (("--adapter", "me"), "expected NAME=PATH"),
        (("--adapter", f"me={tmp_path / 'missing'}"), "is not a folder"),
        (("--adapter-root", str(tmp_path / "missing")), "--adapter-root .*not a folder"),
        (("--max-adapters", "0"), "--max-adapters 0: expected a positive number"),
        (("--adapter-rank", "0"), "--adapter-rank 0: expected a positive number"),
    ):
        with pytest.raises(CommandError, match=message):
            check_adapter_flags(flags(*argv))


def test_the_decode_step_with_adapter_slots_stays_capturable(tmp_path):
    """The slot layers add gathers and batched matmuls, no branch on a tensor, no constant and no
    host sync: draw and feed stay one graph each, capturable (`kernels.capture_check`)."""
    from transformers import CompileConfig

    from transformers_drama3.decoding import step as decode_step
    from transformers_drama3.decoding.loop import DecodeRun, capturable_experts
    from transformers_drama3.decoding.request import RequestOptions, make_sampler, resolve_request
    from transformers_drama3.kernels.capture_check import check_capturable

    model = tiny_model(seed=0)
    trained_adapter(model, tmp_path / "a", seed=1)
    registry = AdapterRegistry(model, max_loaded=2, max_rank=4)
    registry.register("a", tmp_path / "a")
    ids, codes = prompt(1)
    ids, codes, mask = ids[None], codes[None], torch.ones(1, ids.shape[0], dtype=torch.long)
    request = resolve_request(model, ids, mask, RequestOptions(SamplingSettings(top_p=0.9), 3, 20, expected_seconds=1.0))
    sampler = make_sampler(model, request)
    with registry.use("a"):
        run = DecodeRun.prefilled(model, ids, codes, mask, sampler, request.budgets, request.separators,
                                  compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None))
        cache, state = run.cache, run.state
        cache.open_window(cache.tower_part, 1)
        with capturable_experts(model):  # float32 experts: as `compiled_functions` calls the step
            reports = [check_capturable(decode_step.draw, model, cache, sampler, state, None)]
            cache.open_window(cache.backbone_part, 1)
            frames = torch.ones(1, model.config.num_codebooks, dtype=torch.long)
            main_ids = torch.full((1,), model.config.semantic_start_token_id + 3)
            reports.append(check_capturable(decode_step.feed, model, cache, state, main_ids, frames))
    moe_layers = sum(1 for module in model.modules() if type(module).__name__ == "Qwen3_5MoeExperts")
    for report, expert_bmms in zip(reports, (0, 2 * moe_layers)):  # feed's batched experts: 2 bmm per MoE layer
        assert report.graphs == 1 and report.graph_breaks == [] and report.tensor_constants == []
        assert report.host_syncs == [] and report.mutated_inputs == []
        assert report.op_counts.get("aten.bmm.default", 0) > expert_bmms  # the slot layers are in the graph


@pytest.mark.parametrize("change, match", [
    ({"bias": "all"}, "bias='all'; expected 'none'"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out=True"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'; expected 'LORA'"),
    ({"r": 0}, "r=0; expected a positive integer"),
    ({"use_dora": True}, "use_dora=True \\(DoRA adapters\\)"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern=.*per-module ranks"),
])
def test_an_adapter_config_the_slots_cannot_serve_is_refused_naming_the_option(small_registry, tmp_path, change, match):
    model, registry = small_registry
    trained_adapter(model, tmp_path / "c", seed=1)
    config = json.loads((tmp_path / "c" / ADAPTER_CONFIG).read_text())
    (tmp_path / "c" / ADAPTER_CONFIG).write_text(json.dumps({**config, **change}))
    refused(registry, "c", tmp_path / "c", match)


@pytest.mark.parametrize("upload, match", [
    ("not an object", "adapter: expected an object"),
    ({"adapter_config.json": {}, "adapter_model.safetensors": "***"}, "adapter.adapter_model.safetensors: not valid base64"),
    ({"adapter_config.json": {}}, "adapter.adapter_model.safetensors: expected the file in base64"),
    ({"adapter_model.safetensors": ""}, "adapter.adapter_config.json: required"),
    ({"adapter_config.json": 3, "adapter_model.safetensors": ""}, "adapter.adapter_config.json: expected an object or JSON text"),
    ({"weights.bin": ""}, "adapter: unexpected fields \\['weights.bin'\\]"),
])
def test_an_upload_with_bad_fields_is_refused_naming_the_field(upload, match):
    from transformers_drama3.serving.adapters import decode_upload

    with pytest.raises(ValueError, match=match):
        decode_upload(upload)


def test_a_request_refused_by_a_full_queue_gives_its_adapter_back(served):
    from transformers_drama3.serving.engine import QueueFull

    model, _, registry, *_ = served
    engine = Drama3Engine(model, max_batch=1, max_queue=0, adapters=registry)
    with pytest.raises(QueueFull):
        engine.submit(job(seed=1, prompt_seed=1, adapter="alto"))
    assert all(entry.leases == 0 for entry in registry._entries.values())

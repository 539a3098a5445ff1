"""`drama3 plan` / `plan_memory`: the bytes read from a config equal what a loaded model holds."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

from generation_helpers import prompt
from model_helpers import tiny_config, tiny_model
from transformers_drama3 import Drama3ForSpeechGeneration, plan_memory
from transformers_drama3.cli import main as cli_main
from transformers_drama3.runtime.command_line import PLAN_QUANTIZATIONS
from transformers_drama3.decoding.loop import DecodeRun
from transformers_drama3.decoding.state import ColumnKeysLayer, DecodeCache, empty_state
from transformers_drama3.placement import planning
from transformers_drama3.placement.planning import (
    GIB,
    QUANTIZATIONS,
    fitting,
    gpu_table,
    parts_table,
    plan_options,
    refusal,
    state_bytes_per_stream,
)

MEMORY_GUIDE = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "memory.md")
BLOCK_FP8 = {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def part_of(name: str) -> str:
    """The plan's part of a loaded model's tensor, written from the names (not the plan's code)."""
    if ".mlp.experts." in name:
        return "routed_experts"
    if name.startswith(("model.language_model.embed_tokens.", "lm_head.")):
        return "embeddings_and_head"
    if name.startswith("model.language_model."):
        return "dense_backbone"
    assert name.startswith("audio_decoder"), name
    return "tower"


def held_by_part(model: torch.nn.Module) -> dict[str, int]:
    """Storage bytes of every parameter and buffer of `model`, by part (each storage once)."""
    held, seen = dict.fromkeys(("routed_experts", "dense_backbone", "tower", "embeddings_and_head"), 0), set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        held[part_of(name)] += storage.nbytes()
    return held


def storage_bytes(module: torch.nn.Module) -> int:
    return sum(tensor.untyped_storage().nbytes() for tensor in (*module.parameters(), *module.buffers()))


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """A tiny published-layout checkpoint (bf16 experts) and the same model saved with block-FP8 experts."""
    folder = tmp_path_factory.mktemp("plan_tiny")
    tiny_model(seed=1).save_pretrained(folder / "float")
    fp8 = Drama3ForSpeechGeneration(tiny_config(quantization_config=BLOCK_FP8)).to(torch.bfloat16)
    fp8.save_pretrained(folder / "fp8")
    return folder


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_float_plan_equals_what_the_loaded_model_holds(saved_tiny, dtype):
    model = Drama3ForSpeechGeneration.from_pretrained(saved_tiny / "float", dtype=dtype)
    held = held_by_part(model)

    plan = plan_memory(str(saved_tiny / "float"), "none", dtype=dtype)

    for part, loaded in held.items():
        assert getattr(plan, part) == loaded, part


def test_codec_plan_equals_the_codec_the_processor_loads(tiny_checkpoint):
    folder, _, processor = tiny_checkpoint
    from transformers import AutoProcessor

    loaded = AutoProcessor.from_pretrained(folder).codec

    assert plan_memory(folder).codec == storage_bytes(loaded)


def test_fp8_expert_plan_is_the_checkpoints_fp8_experts(saved_tiny):
    # What a GPU with FP8 kernels holds for the experts: the checkpoint's FP8 bytes and their scales.
    stored = 0
    with safe_open(str(saved_tiny / "fp8" / "model.safetensors"), "pt") as tensors:
        for name in tensors.keys():
            if ".mlp.experts." in name:
                tensor = tensors.get_tensor(name)
                stored += tensor.numel() * tensor.element_size()
                expected_dtype = torch.float32 if name.endswith("_scale_inv") else torch.float8_e4m3fn
                assert tensor.dtype == expected_dtype, name

    plan = plan_memory(str(saved_tiny / "fp8"), "fp8")

    assert abs(plan.routed_experts - stored) <= 0.05 * stored
    # everything else is planned in the compute dtype, as with no quantisation
    assert plan.dense_backbone == plan_memory(str(saved_tiny / "fp8"), "none").dense_backbone


# Experts of [64, 64] and a 64-wide shared expert: whole blocks of bitsandbytes' CPU kernel.
QUANTIZED_TEXT = {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}


@pytest.fixture(scope="module")
def quantizable_tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan_quantizable")
    tiny_model(seed=2, text=QUANTIZED_TEXT).to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("option", ["int8", "int4", "nf4"])
def test_quantised_plan_is_within_5_percent_of_what_the_quantised_model_holds(quantizable_tiny, option):
    pytest.importorskip("torchao")
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModel

    from transformers_drama3.checkpoint.quantization import quantization_config_for
    from transformers_drama3.checkpoint.quantization.weights import held_bytes

    config = Drama3ForSpeechGeneration.config_class.from_pretrained(quantizable_tiny)
    quantization = quantization_config_for(option, config, device="cpu", dtype=torch.float32)
    model = AutoModel.from_pretrained(quantizable_tiny, dtype=torch.float32, quantization_config=quantization).eval()
    ids, codes = prompt(0)
    with torch.no_grad():
        model(ids[None], codes[None])  # bitsandbytes repacks its 4-bit weights for the CPU on the first call
    if option == "nf4" and not any(getattr(getattr(p, "quant_state", None), "packing_format_for_cpu", False)
                                   for p in model.parameters()):
        pytest.skip("bitsandbytes' 4-bit CPU kernel (AVX512-BF16) is not used on this machine")
    held = dict.fromkeys(("routed_experts", "dense_backbone", "tower", "embeddings_and_head"), 0)
    for name, size in held_bytes(model).items():
        held[part_of(name)] += size

    plan = plan_memory(str(quantizable_tiny), option, dtype=torch.float32, device="cpu")

    for part, loaded in held.items():
        assert abs(getattr(plan, part) - loaded) <= 0.05 * loaded, (part, getattr(plan, part), loaded)
    assert held["routed_experts"] < plan_memory(str(quantizable_tiny), "none", dtype=torch.float32).routed_experts / 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_state_per_stream_equals_what_a_decode_cache_allocates(dtype):
    model = tiny_model(seed=0).to(dtype)
    ids, codes = prompt(0)
    context = 48
    cache = DecodeCache(model, context, torch.device("cpu"), batch=1)
    run = DecodeRun(model, None, cache, empty_state(model, 1, context, torch.device("cpu")))
    run.extend(ids[None], codes[None])
    allocated = sum(part.next_column.untyped_storage().nbytes() for part in cache.parts)
    for layer in (*cache.backbone.layers, *cache.tower.layers):
        if isinstance(layer, ColumnKeysLayer):
            allocated += layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
        else:
            allocated += layer.conv_states[0].untyped_storage().nbytes() + layer.recurrent_states[0].untyped_storage().nbytes()

    assert state_bytes_per_stream(model.config, context, dtype) == allocated


def test_state_grows_with_context_and_streams(saved_tiny):
    one = plan_memory(str(saved_tiny / "float"), context=100)
    longer = plan_memory(str(saved_tiny / "float"), context=200)
    four = plan_memory(str(saved_tiny / "float"), context=100, streams=4)

    assert longer.state_per_stream > one.state_per_stream
    assert four.state == 4 * one.state_per_stream
    assert four.total - one.total == 3 * one.state_per_stream


def test_quantised_options_shrink_experts_and_dense_projections_only(saved_tiny):
    plans = {plan.quantization: plan for plan in plan_options(str(saved_tiny / "float")) if plan.offload is None}
    none = plans["none"]
    for option in ("int8", "nf4", "int4"):
        assert plans[option].routed_experts < none.routed_experts / 1.5, option
        assert plans[option].dense_backbone < none.dense_backbone, option
        assert (plans[option].tower, plans[option].embeddings_and_head, plans[option].codec) == (
            none.tower, none.embeddings_and_head, none.codec), option
    assert plans["fp8"].dense_backbone == none.dense_backbone


def test_published_plan_follows_the_accounting_of_its_parameters(monkeypatch):
    monkeypatch.setattr(planning, "_cached_file", lambda repo, filename: None)  # whatever this machine caches
    from transformers_drama3.placement.accounting import account

    plan = plan_memory("fishaudio/drama-3", "none")
    counted = account()
    weights = plan.routed_experts + plan.dense_backbone + plan.tower + plan.embeddings_and_head

    assert "published shape" in plan.source
    # every parameter at 2 bytes, plus the backbone's float32 rotary buffers (a few hundred bytes)
    assert 0 <= weights - 2 * counted.total_parameters < 1024
    assert plan_memory("fishaudio/drama-3", "fp8").routed_experts < 0.51 * plan.routed_experts


def test_offload_plan_holds_the_cache_not_the_experts(saved_tiny):
    config = Drama3ForSpeechGeneration.config_class.from_pretrained(saved_tiny / "float").text_config
    resident = plan_memory(str(saved_tiny / "float"))
    offloaded = plan_memory(str(saved_tiny / "float"), offload_cache_experts=3)
    one_expert = 3 * config.moe_intermediate_size * config.hidden_size * 2

    assert offloaded.routed_experts == config.num_hidden_layers * 3 * one_expert
    assert offloaded.offload.host_bytes == resident.routed_experts
    assert offloaded.total - offloaded.routed_experts == resident.total - resident.routed_experts


def test_offload_plan_equals_what_offload_experts_allocates(saved_tiny):
    from transformers_drama3 import offload_experts
    from transformers_drama3.layers.offloaded_experts import OffloadedExperts

    model = offload_experts(Drama3ForSpeechGeneration.from_pretrained(saved_tiny / "float", dtype=torch.bfloat16),
                            cache_experts=3, device="cpu")
    layers = [module for module in model.modules() if isinstance(module, OffloadedExperts)]
    cache = sum(getattr(layer.compute, name).untyped_storage().nbytes() for layer in layers for name in ("gate_up_proj", "down_proj"))
    host = sum(getattr(layer, name).untyped_storage().nbytes() for layer in layers for name in ("gate_up_proj", "down_proj"))

    plan = plan_memory(str(saved_tiny / "float"), offload_cache_experts=3)

    assert plan.routed_experts == plan.offload.cache_bytes == cache
    assert plan.offload.host_bytes == host


def test_options_that_fit_are_listed_most_faithful_first(saved_tiny):
    folder = str(saved_tiny / "float")
    totals = {plan.quantization: plan.total for plan in plan_options(folder) if plan.offload is None}
    card = (totals["int8"] + totals["none"]) / 2  # int8 fits with headroom 0, none does not
    options = plan_options(folder, card / GIB, headroom=0.0)

    fit = fitting(options)

    assert fit == [plan for plan in options if plan.total <= int(card)]
    assert [plan.quantization for plan in fit if plan.offload is None] == [
        option for option in ("fp8", "int8", "nf4", "int4") if totals[option] <= int(card)]
    assert "int8" in [plan.quantization for plan in fit] and fit[-1].offload is not None


def test_block_fp8_checkpoint_prefers_fp8_over_its_dequantised_weights(saved_tiny):
    assert [plan.quantization for plan in plan_options(str(saved_tiny / "fp8"))][:2] == ["fp8", "none"]
    assert [plan.quantization for plan in plan_options(str(saved_tiny / "float"))][:2] == ["none", "fp8"]


def test_offload_gets_the_largest_cache_that_fits(saved_tiny):
    folder = str(saved_tiny / "float")
    resident = plan_memory(folder)
    one_layer_expert = resident.routed_experts // (4 * 4)  # 4 layers x 4 experts, bf16
    without_experts = resident.total - resident.routed_experts
    # room for 3 experts of each layer, not 4
    gib = (without_experts + 4 * 3.5 * one_layer_expert) / GIB
    offloaded = plan_options(folder, gib, headroom=0.0)[-1]

    assert offloaded.offload.cache_experts == 3
    assert offloaded.fits


def test_max_streams_is_the_most_streams_that_fit_the_card_less_its_headroom(saved_tiny):
    """max_streams counts the streams a plan with that many streams fits (the card less 10%): one
    more does not fit. On this card the 10% is room for more than 10 streams, so a count that
    forgot the headroom would be far more than fit."""
    folder = str(saved_tiny / "float")
    one = plan_memory(folder)
    card = (one.total - one.state + 30.5 * one.state_per_stream) / 0.9 / GIB
    plan = plan_memory(folder, gpu_gb=card)
    streams = planning.max_streams(plan)
    assert streams == 30 and card * GIB * 0.1 > 10 * one.state_per_stream
    assert plan_memory(folder, gpu_gb=card, streams=streams).fits
    assert not plan_memory(folder, gpu_gb=card, streams=streams + 1).fits
    assert planning.max_streams(plan_memory(folder)) == 0  # no card, no streams


# ----------------------------------------------------------------------------- a prefill's transients


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


def prefilled(model, ids, codes):
    """A cache of 2 items filled by `model.prefill` of the prompt (twice)."""
    cache = DecodeCache(model, 64, torch.device("cpu"), batch=2)
    mask = torch.ones(2, ids.shape[0], dtype=torch.long)
    with torch.no_grad():
        model.prefill(torch.stack([ids, ids]), torch.stack([codes, codes]), mask, cache)
    return cache


def test_a_prefill_runs_the_towers_layers_but_none_of_its_heads():
    """A prefill fills the tower's cache and makes no codebook logits (it would discard them: 9 x
    4096 values a row); each decode step then runs every head once, on one row an item."""
    model = tiny_model(seed=0)
    rows_seen = []
    hooks = [head.register_forward_hook(lambda module, inputs, out: rows_seen.append(out.shape[-2]))
             for head in model.audio_decoder_mtp.heads]
    ids, codes = prompt(0)
    prefilled(model, ids, codes)
    assert rows_seen == []
    with torch.no_grad():
        model.generate(torch.stack([ids, ids]), torch.stack([codes, codes]), do_sample=False, max_new_tokens=2)
    for hook in hooks:
        hook.remove()
    assert rows_seen and set(rows_seen) == {1}  # the decode steps' heads, one row at a time


def test_the_prefill_fills_the_same_tower_cache_as_a_run_with_its_heads(monkeypatch):
    """Leaving the heads out changes nothing a decode reads: the tower's keys and values after a
    prefill are, bit for bit, those of the teacher-forced run with every head computed."""
    model = tiny_model(seed=0)
    ids, codes = prompt(0)
    without = prefilled(model, ids, codes)
    run_tower = type(model).run_tower
    computed = []

    def with_heads(self, *args, **kwargs):
        computed.append(run_tower(self, *args, **{**kwargs, "heads": True}))
        return None

    monkeypatch.setattr(type(model), "run_tower", with_heads)
    with_logits = prefilled(model, ids, codes)
    assert len(computed) == 1 and computed[0].shape[2:] == (model.config.num_codebooks - 1, 
                                                            model.config.audio_decoder_config.vocab_size)
    for layer, reference in zip(without.tower.layers, with_logits.tower.layers, strict=True):
        assert torch.equal(layer.keys, reference.keys) and torch.equal(layer.values, reference.values)


def test_the_planned_expert_buffers_hold_what_a_published_moe_layer_makes():
    """transformers' grouped GEMM over 4,096 rows of the published layer (bf16, built on the meta
    device): every tensor it makes but its output, as if none were freed, is within the planned
    bytes, and they are not 10% more (the FP8 kernels' bytes: tests/test_fp8_experts_kernel.py)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    config = planning.published_config()
    text = config.text_config
    text._experts_implementation = "grouped_mm"  # the backbone's default
    with torch.device("meta"):
        experts = Qwen3_5MoeExperts(text).to(torch.bfloat16)
    rows, top_k = 4096, text.num_experts_per_tok
    hidden = torch.empty(rows, text.hidden_size, dtype=torch.bfloat16, device="meta")
    index = torch.empty(rows, top_k, dtype=torch.long, device="meta")
    weights = torch.empty(rows, top_k, dtype=torch.bfloat16, device="meta")
    with AllocationLog() as log:
        out = experts(hidden, index, weights)
    made = sum(log.sizes) - out.numel() * out.element_size()
    planned = planning.experts_buffer_bytes(config, rows, "none")
    assert made <= planned <= 1.1 * made
    assert planning.experts_buffer_bytes(config, rows, "int4") == planned  # the quantised options compute alike


def test_a_plan_counts_its_prefills_larger_transient_and_the_workspace():
    config = planning.published_config()
    rows = 32 * 256  # a batch of 32 prompts of 256 rows
    for option in ("none", "fp8"):
        plan = plan_memory(config, option, prefill_rows=rows)
        experts = planning.experts_buffer_bytes(config, rows, option)
        assert plan.prefill == experts and plan.workspace == planning.WORKSPACE_ALLOWANCE == GIB
        assert plan.total - plan_memory(config, option, prefill_rows=1).total == plan.prefill - plan_memory(
            config, option, prefill_rows=1).prefill
    # the FP8 kernels take 4,096 tokens at a time and the tower makes no logits in a prefill: a long
    # batched prefill is bounded (the logits of 64 x 4,096 rows would be 36 GiB)
    fp8_long = planning.experts_buffer_bytes(config, 64 * 4096, "fp8")
    assert fp8_long == planning.experts_buffer_bytes(config, 4096, "fp8") < 0.35 * GIB
    assert plan_memory(config, "fp8", prefill_rows=64 * 4096).prefill == fp8_long


def test_a_plan_that_fits_without_its_transients_does_not_fit_with_them(saved_tiny):
    folder = str(saved_tiny / "float")
    plan = plan_memory(folder, prefill_rows=4096)
    card = (plan.total - plan.transients / 2) / 0.9 / GIB
    assert not plan_memory(folder, gpu_gb=card, prefill_rows=4096).fits
    assert plan_memory(folder, gpu_gb=(plan.total + 1) / 0.9 / GIB, prefill_rows=4096).fits


def test_cli_plan_plans_the_prefill_rows_it_is_given(saved_tiny, capsys):
    folder = str(saved_tiny / "float")
    assert cli_main(["plan", "--model", folder, "--quant", "none", "--prefill-rows", "8192"]) == 0
    out = capsys.readouterr().out
    plan = plan_memory(folder, prefill_rows=8192)
    assert "a prefill of 8192 rows at once" in out
    assert re.search(rf"^none .* {plan.transients / GIB:.2f} +{plan.total / GIB:.2f}$", out, re.MULTILINE)


def test_refusal_names_the_option_and_what_fits(saved_tiny):
    folder = str(saved_tiny / "float")
    totals = {plan.quantization: plan.total for plan in plan_options(folder) if plan.offload is None}
    options = plan_options(folder, (totals["int8"] + totals["none"]) / 2 / GIB, headroom=0.0)
    none = next(plan for plan in options if plan.quantization == "none")

    message = refusal(options, none)

    assert message.startswith("--quant none needs")
    assert "what fits: fp8" in message and "int4" in message


def test_refusal_when_nothing_fits_names_the_smallest_plan_and_the_card_it_needs(saved_tiny):
    options = plan_options(str(saved_tiny / "float"), 1e-6)

    message = refusal(options)

    smallest = min(options, key=lambda plan: plan.total)
    assert "no option fits" in message and smallest.label in message and "use a GPU of at least" in message


def test_cli_plan_prints_every_option_and_what_fits(saved_tiny, capsys):
    folder = str(saved_tiny / "float")
    totals = {plan.quantization: plan.total for plan in plan_options(folder) if plan.offload is None}
    gib = (totals["int8"] + totals["none"]) / 2 / 0.9 / GIB  # int8 fits with the default 10% headroom, none does not

    code = cli_main(["plan", "--model", folder, "--gpu-gb", f"{gib:.9f}"])

    out = capsys.readouterr().out
    assert code == 0
    for option in QUANTIZATIONS:
        assert re.search(rf"^{option} ", out, re.MULTILINE), option
    best = fitting(plan_options(folder, float(f"{gib:.9f}")))[0]
    assert best.quantization != "none"
    assert f"fits: {best.label}; load with: " in out


def test_cli_plan_exits_nonzero_naming_the_option_and_what_fits(saved_tiny, capsys):
    folder = str(saved_tiny / "float")
    totals = {plan.quantization: plan.total for plan in plan_options(folder) if plan.offload is None}
    gib = (min(totals["int4"], totals["nf4"]) + totals["int8"]) / 2 / 0.9 / GIB  # a 4-bit option fits, int8 does not

    code = cli_main(["plan", "--model", folder, "--quant", "int8", "--gpu-gb", f"{gib:.9f}"])

    captured = capsys.readouterr()
    fit = fitting(plan_options(folder, float(f"{gib:.9f}")))
    assert code == 1 and fit
    assert "--quant int8 needs" in captured.err
    assert "what fits: " + ", ".join(plan.label for plan in fit).split(",")[0] in captured.err
    assert all(plan.label in captured.err for plan in fit)
    assert re.search(r"^int8 ", captured.out, re.MULTILINE) and not re.search(r"^none ", captured.out, re.MULTILINE)


def test_cli_plan_exits_nonzero_when_nothing_fits(saved_tiny, capsys):
    code = cli_main(["plan", "--model", str(saved_tiny / "float"), "--gpu-gb", "0.000001"])

    assert code == 1
    assert "no option fits" in capsys.readouterr().err


@pytest.mark.parametrize("argument", [["--gpu-gb", "-24"], ["--gpu-gb", "0"], ["--gpu-gb", "nan"], ["--quant", "q4"],
                                      ["--streams", "0"], ["--context", "-1"], ["--prefill-rows", "0"]])
def test_cli_plan_refuses_bad_values_before_any_work(argument, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["plan", *argument])

    assert exit_.value.code == 2
    assert argument[0] in capsys.readouterr().err


@pytest.mark.parametrize("keywords, named", [
    ({"quantization": "q4"}, "quantization='q4'"),
    ({"gpu_gb": -1}, "gpu_gb=-1"),
    ({"gpu_gb": float("inf")}, "gpu_gb=inf"),
    ({"streams": 0}, "streams=0"),
    ({"context": 0}, "context=0"),
    ({"headroom": 1.0}, "headroom=1.0"),
    ({"dtype": torch.int8}, "dtype=torch.int8"),
    ({"device": "tpu"}, "device='tpu'"),
    ({"prefill_rows": 0}, "prefill_rows=0"),
    ({"offload_cache_experts": 0}, "offload_cache_experts=0"),
    ({"offload_cache_experts": 5}, "offload_cache_experts=5"),
    ({"offload_cache_experts": 2, "quantization": "int4"}, "offload_cache_experts with quantization='int4'"),
])
def test_plan_memory_refuses_bad_values_naming_them(saved_tiny, keywords, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        plan_memory(str(saved_tiny / "float"), **keywords)


def test_plan_memory_refuses_a_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        plan_memory(str(tmp_path))


def test_plan_memory_refuses_a_repo_that_is_not_cached(monkeypatch):
    monkeypatch.setattr(planning, "_cached_file", lambda repo, filename: None)
    with pytest.raises(ValueError, match=r"not in the local Hugging Face cache.*huggingface-cli download someone/else"):
        plan_memory("someone/else")


def test_plan_memory_reads_a_repo_from_the_hugging_face_cache(saved_tiny, tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "models--someone--voice" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((saved_tiny / "float" / "config.json").read_text())
    (tmp_path / "models--someone--voice" / "refs").mkdir()
    (tmp_path / "models--someone--voice" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))

    cached = plan_memory("someone/voice")

    assert "Hugging Face cache" in cached.source
    assert cached.routed_experts == plan_memory(str(saved_tiny / "float")).routed_experts


def test_cli_quant_choices_are_the_plans_options():
    assert PLAN_QUANTIZATIONS is QUANTIZATIONS
def test_the_memory_guides_tables_are_what_the_plan_prints(monkeypatch):
    monkeypatch.setattr(planning, "_cached_file", lambda repo, filename: None)
    with open(MEMORY_GUIDE, encoding="utf-8") as reader:
        guide = reader.read()

    assert parts_table() in guide
    assert gpu_table() in guide


def test_model_card_memory_figures_are_what_the_plan_gives(monkeypatch):
    monkeypatch.setattr(planning, "_cached_file", lambda repo, filename: None)
    with open(os.path.join(os.path.dirname(__file__), os.pardir, "model_card.md"), encoding="utf-8") as reader:
        card = " ".join(reader.read().split())
    totals = {plan.quantization: plan.total / GIB for plan in plan_options() if plan.offload is None}
    offload = fitting(plan_options(gpu_gb=24))[0]

    assert f"{totals['fp8']:.1f} GiB with the published FP8 experts" in card
    assert f"{totals['none']:.1f} GiB dequantised to bf16" in card
    assert f"{totals['int8']:.1f} GiB int8, {totals['nf4']:.1f} GiB nf4, {totals['int4']:.1f} GiB int4" in card
    assert f"{offload.offload.cache_experts} of each layer's {offload.offload.num_experts} cached" in card
    assert f"(`offload_experts`, {offload.total / GIB:.1f} GiB)" in card


def test_every_list_of_quantisation_schemes_is_the_one_table():
    from transformers_drama3.checkpoint.quantization import quantized_loading, schemes, weights
    from transformers_drama3.runtime.command_line import EVAL_QUANTIZATIONS

    assert EVAL_QUANTIZATIONS is schemes.WEIGHT_OPTIONS is quantized_loading.WEIGHT_OPTIONS
    assert weights.OPTIONS is schemes.BYTE_COUNTED
    assert QUANTIZATIONS is schemes.PLAN_OPTIONS
    assert set(schemes.PLAN_OPTIONS) - {"none"} <= set(schemes.BYTE_COUNTED)  # every plan's bytes are counted

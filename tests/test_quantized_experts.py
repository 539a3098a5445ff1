"""Drama 3 through transformers' weight quantisers (torchao int8 / int4, bitsandbytes nf4 / 8-bit),
routed experts included, from tiny checkpoints in the published layout (bfloat16 and block-FP8 experts).

The reference is the same checkpoint loaded dense in float32; each option's logits stay within an
error bound of it that a quantiser computing the wrong weights exceeds (the last test breaks the
FP8 dequantisation on purpose and checks the bound catches it).
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from safetensors.torch import save_file

from generation_helpers import prompt, reference_greedy
from model_helpers import tiny_config, tiny_model
from transformers import AutoModel
from transformers_drama3.checkpoint.quantization import (
    Drama3RoutedExperts,
    is_routed_expert_weight,
    quantize_block_fp8,
    routed_experts_from_fused,
    split_expert_weights,
)
from transformers_drama3.checkpoint.quantization import quantized_loading
from transformers_drama3.checkpoint.quantization.quantized_loading import (
    QuantizationRefused,
    quantization_config_for,
    quantized_lora_config,
)
from transformers_drama3.checkpoint.quantization.weights import held_bytes, quantized_bytes
from transformers_drama3.training.lora import lora_config

pytest.importorskip("torchao")
pytest.importorskip("bitsandbytes")

# Experts of [64, 64]: whole blocks of bitsandbytes' CPU kernel (32 rows, 64 inputs), two FP8 blocks a side.
TEXT = {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
FP8_BLOCK = [32, 32]
OPTIONS = ("int8", "int4", "nf4", "bnb-int8")
# Relative L2 error of the logits against the dense float32 model, measured on these checkpoints
# (benchmarks/quantized_experts.py prints them): int8 ~0.004, bnb-int8 ~0.006, int4 ~0.07, nf4 ~0.07;
# computing in bfloat16 alone gives ~0.006. Wrong weights (a dropped FP8 scale) give errors of order 1.
TOLERANCE = {"int8": 0.02, "bnb-int8": 0.03, "int4": 0.15, "nf4": 0.15}
QUANTIZED_TYPES = {"int8": "Int8Tensor", "int4": "IntxUnpackedToInt8Tensor", "nf4": "Params4bit", "bnb-int8": "Int8Params"}


def write_published(directory, fp8: bool, seed: int = 0) -> None:
    """A tiny checkpoint in the published layout: bfloat16 tensors, float32 A_log, per-expert
    names, and block-FP8 experts when `fp8`, each block scaled by its own factor in 1/2 .. 2 (so
    that every block has its own scale)."""
    directory.mkdir(parents=True, exist_ok=True)
    quantization = {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": FP8_BLOCK}
    config = tiny_config(text=TEXT, **({"quantization_config": quantization} if fp8 else {}))
    config.dtype = torch.bfloat16
    config.save_pretrained(directory)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in split_expert_weights(tiny_model(seed, text=TEXT).state_dict()).items():
        if name.endswith(".linear_attn.A_log"):
            tensors[name] = tensor.float()
        elif fp8 and is_routed_expert_weight(name):
            rows, columns = tensor.shape
            grid = (math.ceil(rows / FP8_BLOCK[0]), math.ceil(columns / FP8_BLOCK[1]))
            factors = 2.0 ** (2 * torch.rand(grid, generator=generator) - 1)
            scaled = tensor * factors.repeat_interleave(FP8_BLOCK[0], 0)[:rows].repeat_interleave(FP8_BLOCK[1], 1)[:, :columns]
            tensors[name], tensors[name + "_scale_inv"] = quantize_block_fp8(scaled, tuple(FP8_BLOCK))
        else:
            tensors[name] = tensor.to(torch.bfloat16)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    write_published(root / "bf16", fp8=False)
    write_published(root / "fp8", fp8=True)
    return root


@pytest.fixture(scope="module")
def dense(checkpoints):
    return {kind: AutoModel.from_pretrained(checkpoints / kind, dtype=torch.float32).eval() for kind in ("bf16", "fp8")}


_LOADED = {}


def load(checkpoints, kind: str, option: str):
    """The checkpoint `kind` quantised under `option`, computing in float32 (loaded once per module)."""
    key = (str(checkpoints), kind, option)
    if key not in _LOADED:
        quantization = quantization_config_for(option, tiny_config(text=TEXT), device="cpu", dtype=torch.float32)
        _LOADED[key] = AutoModel.from_pretrained(checkpoints / kind, dtype=torch.float32, quantization_config=quantization).eval()
    return _LOADED[key]


def relative_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return float((logits - reference).norm() / reference.norm())


def forward_logits(model, seed: int = 0):
    ids, codes = prompt(seed)
    with torch.no_grad():
        output = model(ids[None], codes[None])
    return output.logits, output.codebook_logits


# ----------------------------------------------------------------------------- the experts module


def test_per_expert_linears_compute_the_fused_experts():
    model = tiny_model(0, text=TEXT)
    fused = model.backbone.layers[0].mlp.experts
    split = routed_experts_from_fused(fused, model.config.text_config)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, model.config.text_config.hidden_size, generator=generator)
    top_k_index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(9)])
    top_k_weights = torch.rand(9, 2, generator=generator)
    torch.testing.assert_close(split(hidden, top_k_index, top_k_weights), fused(hidden, top_k_index, top_k_weights))


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("option", OPTIONS)
def test_quantised_load_converts_experts_and_dense_projections_and_keeps_the_rest(checkpoints, kind, option):
    model = load(checkpoints, kind, option)
    quantized, kept = QUANTIZED_TYPES[option], {"Parameter", "Tensor"}
    layers = model.backbone.layers
    assert all(isinstance(layer.mlp.experts, Drama3RoutedExperts) for layer in layers)
    for layer in layers:
        for expert in layer.mlp.experts:
            for projection in (expert.gate_proj, expert.up_proj, expert.down_proj):
                assert type(projection.weight).__name__ == quantized
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert type(getattr(layer.mlp.shared_expert, name).weight).__name__ == quantized
        assert type(layer.mlp.gate.weight).__name__ in kept
        assert type(layer.mlp.shared_expert_gate.weight).__name__ in kept
        attention = layer.self_attn if hasattr(layer, "self_attn") else layer.linear_attn
        dense_projection = attention.q_proj if hasattr(layer, "self_attn") else attention.in_proj_qkv
        assert type(dense_projection.weight).__name__ == quantized
    assert type(model.lm_head.weight).__name__ in kept
    for name, module in model.named_modules():
        if name.startswith(("audio_decoder", "lm_head")) and isinstance(module, torch.nn.Linear):
            assert type(module.weight).__name__ in kept and module.weight.dtype == torch.float32, name
    assert model.loaded_checkpoint is None  # nothing kept for a published save


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("option", OPTIONS)
def test_quantised_logits_stay_within_the_options_error_of_the_dense_model(checkpoints, dense, kind, option):
    logits, codebook_logits = forward_logits(load(checkpoints, kind, option))
    reference, reference_codebooks = forward_logits(dense[kind])
    assert relative_error(logits, reference) < TOLERANCE[option]
    assert relative_error(codebook_logits, reference_codebooks) < TOLERANCE[option]


# Relative error of each MoE block's output (router, routed and shared experts) on random hidden
# states, measured: int8 ~0.012, bnb-int8 ~0.018, int4 ~0.17, nf4 ~0.17; the int8 model with its
# routing weights dropped gives ~0.08, with each expert's gate and up swapped ~0.25.
MOE_TOLERANCE = {"int8": 0.03, "bnb-int8": 0.04, "int4": 0.22, "nf4": 0.22}


def moe_block_error(model, reference) -> float:
    """The largest, over layers, relative error of the MoE block's output against `reference`'s."""
    generator = torch.Generator().manual_seed(0)
    errors = []
    for layer, reference_layer in zip(model.backbone.layers, reference.backbone.layers):
        hidden = torch.randn(1, 16, model.config.text_config.hidden_size, generator=generator)
        with torch.no_grad():
            errors.append(relative_error(layer.mlp(hidden), reference_layer.mlp(hidden)))
    return max(errors)


@pytest.mark.parametrize("option", OPTIONS)
def test_each_moe_block_stays_within_the_options_error_of_the_dense_block(checkpoints, dense, option):
    assert moe_block_error(load(checkpoints, "fp8", option), dense["fp8"]) < MOE_TOLERANCE[option]


def test_experts_that_drop_their_routing_weights_exceed_the_int8_bound(checkpoints, dense, monkeypatch):
    forward = Drama3RoutedExperts.forward
    monkeypatch.setattr(
        Drama3RoutedExperts, "forward",
        lambda self, hidden, index, weights: forward(self, hidden, index, torch.full_like(weights, 1 / weights.shape[-1])),
    )
    assert moe_block_error(load(checkpoints, "fp8", "int8"), dense["fp8"]) > MOE_TOLERANCE["int8"]


def test_block_fp8_experts_are_dequantised_one_projection_at_a_time(checkpoints, monkeypatch):
    alive, most_alive, calls = [], [0], [0]
    dequantize = quantized_loading.dequantize_block_fp8

    def counting(*args, **kwargs):
        dense = dequantize(*args, **kwargs)
        alive[:] = [ref for ref in alive if ref() is not None]
        most_alive[0] = max(most_alive[0], len(alive) + 1)
        alive.append(weakref.ref(dense))
        calls[0] += 1
        return dense

    monkeypatch.setattr(quantized_loading, "dequantize_block_fp8", counting)
    quantization = quantization_config_for("nf4", tiny_config(text=TEXT), device="cpu", dtype=torch.float32)
    model = AutoModel.from_pretrained(checkpoints / "fp8", dtype=torch.float32, quantization_config=quantization)
    text = model.config.text_config
    assert calls[0] == text.num_hidden_layers * text.num_experts * 3  # every expert projection, once
    assert most_alive[0] == 1  # never two dense expert projections at once


def test_quantised_memory_is_what_quantized_bytes_predicts(checkpoints):
    """Each quantised linear holds exactly `quantized_bytes` of its shape (after a first inference
    call, which on the CPU repacks bitsandbytes' 4-bit weights), and the model less than dense."""
    for option in OPTIONS:
        model = load(checkpoints, "bf16", option)
        forward_logits(model)
        held = held_bytes(model)
        group = quantized_loading.int4_group_size(model.config)
        predicted, actual = 0, 0
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if weight is None or type(weight).__name__ != QUANTIZED_TYPES[option]:
                continue
            if option == "nf4" and not getattr(weight.quant_state, "packing_format_for_cpu", False):
                pytest.skip("bitsandbytes' 4-bit CPU kernel (AVX512-BF16) is not used on this machine")
            shape = (module.out_features, module.in_features)
            predicted += quantized_bytes(shape, option, device="cpu", dtype=torch.float32, group_size=group)
            actual += held[name + ".weight"]
        assert actual == predicted, option
        dense_bytes = sum(held_bytes(load_dense_copy(checkpoints)).values())
        assert sum(held.values()) < dense_bytes


_DENSE = {}


def load_dense_copy(checkpoints):
    if "model" not in _DENSE:
        _DENSE["model"] = AutoModel.from_pretrained(checkpoints / "bf16", dtype=torch.float32)
    return _DENSE["model"]


def test_quantized_bytes_of_each_option():
    assert quantized_bytes((512, 2048), "fp8") == 512 * 2048 + 4 * 4 * 16
    assert quantized_bytes((256, 512, 2048), "nf4") == 256 * (512 * 2048 // 2 + 4 * 512 * 2048 // 64 + 64)
    assert quantized_bytes((512, 2048), "nf4", device="cpu") == 512 * 2048 // 2 + 2 * 512 * 2048 // 64 + 64
    assert quantized_bytes((512, 2048), "int4", device="cuda") == 512 * 1024 + 512 * 16 * 4
    assert quantized_bytes((512, 2048), "int4", device="cpu", dtype=torch.bfloat16) == 512 * 2048 + 512 * 16 * 3
    with pytest.raises(ValueError, match="option='int3'"):
        quantized_bytes((4, 4), "int3")


# ----------------------------------------------------------------------------- generate, stream, engine


@pytest.mark.parametrize("kind,option", [("fp8", "int8"), ("fp8", "nf4"), ("bf16", "int4"), ("bf16", "bnb-int8")])
def test_quantised_model_generates_its_own_greedy_frames_and_streams_them(checkpoints, kind, option):
    model = load(checkpoints, kind, option)
    ids, codes = prompt(3)
    out = model.generate(ids[None], codes[None], do_sample=False, max_new_tokens=6, return_dict_in_generate=True)
    frames = out.audio_codes[0, : int(out.lengths[0])]
    with torch.no_grad():
        expected, _ = reference_greedy(model, ids, codes, 6)
    assert torch.equal(frames, expected)
    streamed = [chunk.codes for chunk in model.stream(ids, codes, do_sample=False, max_new_tokens=6) if chunk.codes.numel()]
    assert torch.equal(torch.cat(streamed, dim=-2).reshape(-1, frames.shape[-1]), frames)


def test_quantised_model_serves_through_the_engine(checkpoints):
    from transformers_drama3.decoding.sampler import SamplingSettings
    from transformers_drama3.serving.engine import DoneEvent, Drama3Engine, SpeechJob

    model = load(checkpoints, "fp8", "int8")
    ids, codes = prompt(4)
    engine = Drama3Engine(model, max_batch=2)
    handle = engine.submit(SpeechJob(ids[None], codes[None], SamplingSettings(do_sample=False), seed=0, max_new_tokens=5))
    while not engine.idle:
        engine.step()
    result = handle.result(timeout=1)
    out = model.generate(ids[None], codes[None], do_sample=False, max_new_tokens=5, return_dict_in_generate=True)
    assert isinstance(result, DoneEvent)
    assert torch.equal(result.codes, out.audio_codes[0, : int(out.lengths[0])])


# ----------------------------------------------------------------------------- QLoRA


@pytest.mark.parametrize(
    "kind,option,preset", [("fp8", "nf4", "heavy"), ("fp8", "int8", "light"), ("bf16", "int4", "heavy"), ("bf16", "bnb-int8", "light")]
)
def test_qlora_over_the_quantised_model_lowers_the_loss(checkpoints, kind, option, preset):
    from peft import get_peft_model

    quantization = quantization_config_for(option, tiny_config(text=TEXT), device="cpu", dtype=torch.float32)
    model = AutoModel.from_pretrained(checkpoints / kind, dtype=torch.float32, quantization_config=quantization)
    peft_model = get_peft_model(model, quantized_lora_config(lora_config(model, preset, r=4)))
    trainable = [name for name, parameter in peft_model.named_parameters() if parameter.requires_grad]
    if preset == "heavy":
        assert any("experts.0.down_proj.lora_A" in name for name in trainable)
    assert not any("lora" not in name and "modules_to_save" not in name for name in trainable)
    ids, codes = prompt(5)
    batch = dict(input_ids=ids[None], audio_codes=codes[None], labels=ids[None].clone())
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model.train()
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = peft_model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0]


# ----------------------------------------------------------------------------- refusals


@pytest.fixture
def config_only(tmp_path):
    """A folder with a config and no weights: a load that got as far as reading weights fails with
    OSError, so a QuantizationRefused shows the request was refused before."""
    write_published(tmp_path / "checkpoint", fp8=True)
    (tmp_path / "checkpoint" / "model.safetensors").unlink()
    return tmp_path / "checkpoint"


@pytest.mark.parametrize("package,option,suggested", [("torchao", "int8", "nf4"), ("bitsandbytes", "nf4", "int8")])
def test_a_quantiser_not_installed_is_refused_naming_what_fits(config_only, monkeypatch, package, option, suggested):
    quantization = quantization_config_for(option, device="cpu")
    real = quantized_loading.installed
    monkeypatch.setattr(quantized_loading, "installed", lambda name: name != package and real(name))
    with pytest.raises(QuantizationRefused, match=rf"needs {package}, which is not installed.*{suggested}"):
        AutoModel.from_pretrained(config_only, quantization_config=quantization)
    with pytest.raises(QuantizationRefused, match=f"needs {package}"):
        quantization_config_for(option, device="cpu")


def test_int4_packed_for_cuda_is_refused_on_the_cpu(config_only):
    quantization = quantization_config_for("int4", device="cuda")
    with pytest.raises(QuantizationRefused, match=r"CUDA kernels only.*device='cpu'.*nf4"):
        AutoModel.from_pretrained(config_only, quantization_config=quantization)


def test_int4_packed_for_cuda_is_refused_in_float32(config_only, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    quantization = quantization_config_for("int4", tiny_config(text=TEXT), device="cuda")
    with pytest.raises(QuantizationRefused, match=r"bfloat16 only; got dtype=torch.float32"):
        AutoModel.from_pretrained(config_only, quantization_config=quantization, device_map="cuda", dtype=torch.float32)


def test_an_int4_group_that_does_not_divide_the_inputs_is_refused(config_only):
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup
    from transformers import TorchAoConfig

    quantization = TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(128)))
    with pytest.raises(QuantizationRefused, match=r"group_size=128.*group_size=32 fits"):
        AutoModel.from_pretrained(config_only, quantization_config=quantization)


def test_nf4_on_the_cpu_with_skips_that_leave_kernel_misfits_is_refused(config_only):
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", llm_int8_skip_modules=["lm_head"])
    with pytest.raises(QuantizationRefused, match=r"multiples of 32.*in_proj_\(a\|b\)"):
        AutoModel.from_pretrained(config_only, quantization_config=quantization)


def test_an_unknown_option_is_refused():
    with pytest.raises(QuantizationRefused, match="'int2'.*int8, int4, nf4, bnb-int8"):
        quantization_config_for("int2")


# ----------------------------------------------------------------------------- the bound catches wrong weights


def test_a_wrong_fp8_dequantisation_exceeds_the_error_bound(checkpoints, dense, monkeypatch):
    """The bound of the logits test is tight enough: experts read without their block scales fail it."""
    def unscaled(weight, scale_inv, block, dtype):
        return weight.to(dtype)

    monkeypatch.setattr(quantized_loading, "dequantize_block_fp8", unscaled)
    quantization = quantization_config_for("int8", tiny_config(text=TEXT), device="cpu", dtype=torch.float32)
    model = AutoModel.from_pretrained(checkpoints / "fp8", dtype=torch.float32, quantization_config=quantization)
    logits, _ = forward_logits(model)
    reference, _ = forward_logits(dense["fp8"])
    assert relative_error(logits, reference) > TOLERANCE["nf4"]


def test_fp8_experts_without_their_config_are_refused(checkpoints, tmp_path):
    """FP8 bytes read without their scales would be wrong weights: a checkpoint whose config lost
    its "bsgemm-moe" quantization_config is refused, naming the file and the missing config."""
    import shutil

    folder = tmp_path / "unstated"
    shutil.copytree(checkpoints / "fp8", folder)
    tiny_config(text=TEXT).save_pretrained(folder)  # the same model, no quantization_config
    quantization = quantization_config_for("int8", tiny_config(text=TEXT), device="cpu")
    with pytest.raises(ValueError, match=r"model.safetensors: holds block-FP8 weights .*bsgemm-moe"):
        AutoModel.from_pretrained(folder, quantization_config=quantization)


def test_a_cuda_device_map_without_a_gpu_is_refused(config_only, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    quantization = quantization_config_for("int8", device="cpu")
    with pytest.raises(QuantizationRefused, match=r"device_map='cuda': this machine has no CUDA GPU"):
        AutoModel.from_pretrained(config_only, quantization_config=quantization, device_map="cuda")


# ----------------------------------------------------------------------------- drama3 eval --quant


def test_the_commands_loader_quantises_drama3_tiny():
    from transformers_drama3.runtime.loading import load_model_and_processor
    from transformers_drama3.tiny import shipped

    if not shipped.is_available():
        pytest.skip("this installation carries no drama3-tiny")
    model, processor = load_model_and_processor(shipped.TINY_MODEL_PATH, "cpu", "float32", progress=False, quant="int8")
    assert type(model.backbone.layers[0].mlp.experts[0].down_proj.weight).__name__ == "Int8Tensor"
    assert processor.codec is not None


def test_the_commands_loader_names_quant_when_refused(monkeypatch):
    from transformers_drama3.runtime.loading import CommandError, load_model_and_processor
    from transformers_drama3.tiny import shipped

    real = quantized_loading.installed
    monkeypatch.setattr(quantized_loading, "installed", lambda name: name != "bitsandbytes" and real(name))
    with pytest.raises(CommandError, match=r"--quant nf4: .*needs bitsandbytes"):
        load_model_and_processor(shipped.TINY_MODEL_PATH, "cpu", "float32", progress=False, quant="nf4")


# ----------------------------------------------------------------------------- saving


@pytest.mark.parametrize("option", ["int8", "int4"])
def test_a_torchao_quantised_model_saves_and_loads_back_the_same(checkpoints, tmp_path, option):
    model = load(checkpoints, "fp8", option)
    model.save_pretrained(tmp_path / "saved")
    back = AutoModel.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    assert isinstance(back.backbone.layers[0].mlp.experts, Drama3RoutedExperts)
    assert type(back.backbone.layers[0].mlp.experts[1].up_proj.weight).__name__ == QUANTIZED_TYPES[option]
    assert torch.equal(forward_logits(back)[0], forward_logits(model)[0])


def test_a_bitsandbytes_quantised_model_is_refused_before_anything_is_written(checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"quantised by bitsandbytes .* not supported.*torchao"):
        load(checkpoints, "fp8", "nf4").save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_a_folder_saved_from_a_bitsandbytes_model_is_refused(checkpoints, tmp_path):
    import json
    import shutil

    shutil.copytree(checkpoints / "bf16", tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (tmp_path / "saved" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"saved from a model quantised by bitsandbytes"):
        AutoModel.from_pretrained(tmp_path / "saved")

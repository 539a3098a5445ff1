"""Block-FP8 routed experts ("bsgemm-moe"): quantisation, state dicts, expert layout, transformers."""

import json
import math

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from transformers_drama3.checkpoint.quantization import (
    FP8_DTYPE,
    FP8_MAX,
    NON_EXPERT_MODULES,
    dequantize_block_fp8,
    dequantize_block_fp8_reference,
    dequantize_state_dict,
    fp8_quantization_config_for_cuda,
    fuse_expert_weights,
    is_block_fp8_config,
    is_routed_expert_weight,
    quantize_block_fp8,
    quantize_block_fp8_power_of_two,
    quantize_state_dict,
    scale_rule,
    split_expert_weights,
    transformers_quantization_config,
    weight_block_size,
)


PUBLISHED_CONFIG = {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
EXPERTS = "model.language_model.layers.0.mlp.experts"
# Whole blocks; partial edge blocks; several partial blocks on both axes.
SHAPES_AND_BLOCKS = [((256, 384), (128, 128)), ((200, 72), (128, 128)), ((200, 72), (64, 32))]


def blockwise_weight(rows, columns, block, seed=0):
    """Gaussian weight whose blocks span magnitudes 1e-4 .. 1e2, so each block has its own scale."""
    generator = torch.Generator().manual_seed(seed)
    block_rows, block_columns = math.ceil(rows / block[0]), math.ceil(columns / block[1])
    magnitudes = 10.0 ** torch.linspace(-4, 2, block_rows * block_columns).reshape(block_rows, block_columns)
    magnitudes = magnitudes.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
    return torch.randn(rows, columns, generator=generator) * magnitudes


def expanded_scale(scale_inv, shape, block):
    return scale_inv.double().repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def expert_state_dict(num_experts=3, intermediate=8, hidden=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    state = {"model.language_model.embed_tokens.weight": torch.randn(5, hidden, generator=generator)}
    for expert in range(num_experts):
        state[f"{EXPERTS}.{expert}.down_proj.weight"] = torch.randn(hidden, intermediate, generator=generator)
        state[f"{EXPERTS}.{expert}.gate_proj.weight"] = torch.randn(intermediate, hidden, generator=generator)
        state[f"{EXPERTS}.{expert}.up_proj.weight"] = torch.randn(intermediate, hidden, generator=generator)
    state["model.language_model.layers.0.mlp.shared_expert.gate_proj.weight"] = torch.randn(
        intermediate, hidden, generator=generator
    )
    state["lm_head.weight"] = torch.randn(5, hidden, generator=generator)
    return state


# Quantisation


@pytest.mark.parametrize(("shape", "block"), SHAPES_AND_BLOCKS)
def test_round_trip_error_is_within_e4m3_rounding(shape, block):
    weight = blockwise_weight(*shape, block)
    weight_fp8, scale_inv = quantize_block_fp8(weight, block)
    dense = dequantize_block_fp8(weight_fp8, scale_inv, block, dtype=torch.float64)
    scale = expanded_scale(scale_inv, shape, block)
    # 3 mantissa bits: half an ulp is 2^-4 of a normal value; subnormal spacing is 2^-9 * scale.
    bound = 2.0**-4 * weight.double().abs() + 2.0**-10 * scale
    assert ((dense - weight.double()).abs() <= bound * (1 + 2.0**-20)).all()


def test_scale_grid_covers_partial_edge_blocks():
    weight_fp8, scale_inv = quantize_block_fp8(torch.randn(200, 72), (128, 128))
    assert weight_fp8.shape == (200, 72) and weight_fp8.dtype == FP8_DTYPE
    assert scale_inv.shape == (2, 1) and scale_inv.dtype == torch.float32


def test_each_block_scale_is_its_amax_over_fp8_max():
    block = (64, 32)
    weight = blockwise_weight(200, 72, block)
    weight_fp8, scale_inv = quantize_block_fp8(weight, block)
    for block_row in range(scale_inv.shape[0]):
        for block_column in range(scale_inv.shape[1]):
            rows = slice(block_row * block[0], (block_row + 1) * block[0])
            columns = slice(block_column * block[1], (block_column + 1) * block[1])
            amax = weight[rows, columns].abs().max()
            assert scale_inv[block_row, block_column] == amax / FP8_MAX
            assert weight_fp8[rows, columns].float().abs().max() == FP8_MAX


def test_zero_block_has_unit_scale_and_dequantizes_to_zero():
    weight = torch.randn(256, 256)
    weight[128:, :128] = 0
    weight_fp8, scale_inv = quantize_block_fp8(weight)
    assert scale_inv[1, 0] == 1.0
    dense = dequantize_block_fp8(weight_fp8, scale_inv, dtype=torch.float32)
    assert torch.equal(dense[128:, :128], torch.zeros(128, 128))
    assert torch.isfinite(scale_inv).all() and (scale_inv > 0).all()


def test_power_of_two_scales_round_each_block_scale_up():
    block = (64, 32)
    weight = blockwise_weight(200, 72, block, seed=3)
    _, exact = quantize_block_fp8(weight, block)
    weight_fp8, scale_inv = quantize_block_fp8_power_of_two(weight, block)
    assert torch.equal(torch.frexp(scale_inv).mantissa, torch.full_like(scale_inv, 0.5))
    assert (scale_inv >= exact).all() and (scale_inv < 2 * exact).all()
    dense = dequantize_block_fp8(weight_fp8, scale_inv, block, dtype=torch.float64)
    bound = 2.0**-4 * weight.double().abs() + 2.0**-10 * expanded_scale(scale_inv, weight.shape, block)
    assert ((dense - weight.double()).abs() <= bound * (1 + 2.0**-20)).all()


@pytest.mark.parametrize(
    ("quantizer", "rule"), [(quantize_block_fp8, "amax"), (quantize_block_fp8_power_of_two, "power_of_two")]
)
def test_scale_rule_is_read_off_the_stored_blocks(quantizer, rule):
    weight = blockwise_weight(256, 384, (128, 128), seed=4)
    weight[:128, :128] = 0  # a zero block fits either rule
    assert scale_rule(*quantizer(weight)) == rule


def test_scale_rule_is_none_for_scales_with_headroom():
    weight_fp8, scale_inv = quantize_block_fp8(blockwise_weight(256, 384, (128, 128), seed=5))
    # the same values stored with 3 times the scale: codes no longer reach 448, scales not powers of two
    codes = (weight_fp8.float() / 3).to(FP8_DTYPE)
    assert scale_rule(codes, scale_inv * 3) is None


def test_leading_dimensions_quantize_each_matrix_alone():
    weights = torch.randn(3, 200, 72)
    weight_fp8, scale_inv = quantize_block_fp8(weights, (64, 32))
    dense = dequantize_block_fp8(weight_fp8, scale_inv, (64, 32))
    for index in range(3):
        alone_fp8, alone_scale = quantize_block_fp8(weights[index], (64, 32))
        assert torch.equal(weight_fp8[index].view(torch.uint8), alone_fp8.view(torch.uint8))
        assert torch.equal(scale_inv[index], alone_scale)
        assert torch.equal(dense[index], dequantize_block_fp8(alone_fp8, alone_scale, (64, 32)))


@pytest.mark.parametrize(("dtype", "relative"), [(torch.float32, 2.0**-24), (torch.bfloat16, 2.0**-8)])
@pytest.mark.parametrize(("shape", "block"), SHAPES_AND_BLOCKS)
def test_dequantize_matches_float64_reference(shape, block, dtype, relative):
    weight_fp8, scale_inv = quantize_block_fp8(blockwise_weight(*shape, block, seed=1), block)
    reference = dequantize_block_fp8_reference(weight_fp8, scale_inv, block)
    dense = dequantize_block_fp8(weight_fp8, scale_inv, block, dtype=dtype)
    assert dense.dtype == dtype and dense.shape == shape
    assert ((dense.double() - reference).abs() <= relative * reference.abs()).all()


def test_dequantize_rejects_a_scale_grid_of_the_wrong_shape():
    weight_fp8, scale_inv = quantize_block_fp8(torch.randn(200, 72))
    with pytest.raises(ValueError, match=r"scale_inv .* must have shape \(2, 1\)"):
        dequantize_block_fp8(weight_fp8, scale_inv.T.repeat(1, 2), (128, 128))


# Config


def test_published_config_is_block_fp8_with_128_blocks():
    assert is_block_fp8_config(PUBLISHED_CONFIG)
    assert weight_block_size(PUBLISHED_CONFIG) == (128, 128)
    assert not is_block_fp8_config(None)
    assert not is_block_fp8_config({"quant_method": "fp8"})


def test_weight_block_size_rejects_a_malformed_block():
    with pytest.raises(ValueError, match="weight_block_size"):
        weight_block_size({**PUBLISHED_CONFIG, "weight_block_size": [128]})


# State dicts


def test_routed_expert_predicate_excludes_shared_expert_and_scales():
    assert is_routed_expert_weight(f"{EXPERTS}.17.down_proj.weight")
    assert not is_routed_expert_weight("model.language_model.layers.0.mlp.shared_expert.down_proj.weight")
    assert not is_routed_expert_weight(f"{EXPERTS}.17.down_proj.weight_scale_inv")
    assert not is_routed_expert_weight(f"{EXPERTS}.gate_up_proj")


def test_quantize_state_dict_adds_a_scale_after_each_routed_expert_weight():
    state = expert_state_dict()
    quantized, names = quantize_state_dict(state)
    assert names == [name for name in state if is_routed_expert_weight(name)]
    expected_keys = []
    for name in state:
        expected_keys += [name, name + "_scale_inv"] if name in names else [name]
    assert list(quantized) == expected_keys
    assert all(quantized[name].dtype == FP8_DTYPE for name in names)
    assert quantized["lm_head.weight"] is state["lm_head.weight"]


def test_dequantize_state_dict_restores_the_names_exactly():
    state = expert_state_dict()
    quantized, quantized_names = quantize_state_dict(state)
    dense, dequantized_names = dequantize_state_dict(quantized, dtype=torch.float32)
    assert list(dense) == list(state)
    assert dequantized_names == quantized_names
    assert dense["lm_head.weight"] is state["lm_head.weight"]
    for name in dequantized_names:
        assert dense[name].dtype == torch.float32
        scale_inv = quantized[name + "_scale_inv"]
        assert torch.equal(dense[name], dequantize_block_fp8(quantized[name], scale_inv, dtype=torch.float32))


def test_dequantize_state_dict_rejects_fp8_without_scale():
    quantized, _ = quantize_state_dict(expert_state_dict())
    del quantized[f"{EXPERTS}.0.up_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match=r"experts\.0\.up_proj\.weight.* has no .*weight_scale_inv"):
        dequantize_state_dict(quantized)


# Fused experts


def test_fuse_stacks_experts_with_gate_rows_before_up_rows():
    state = expert_state_dict(num_experts=3, intermediate=8, hidden=12)
    fused = fuse_expert_weights(state)
    assert fused[f"{EXPERTS}.gate_up_proj"].shape == (3, 16, 12)
    assert fused[f"{EXPERTS}.down_proj"].shape == (3, 12, 8)
    assert torch.equal(fused[f"{EXPERTS}.gate_up_proj"][2, :8], state[f"{EXPERTS}.2.gate_proj.weight"])
    assert torch.equal(fused[f"{EXPERTS}.gate_up_proj"][2, 8:], state[f"{EXPERTS}.2.up_proj.weight"])
    assert list(fused) == [
        "model.language_model.embed_tokens.weight",
        f"{EXPERTS}.gate_up_proj",
        f"{EXPERTS}.down_proj",
        "model.language_model.layers.0.mlp.shared_expert.gate_proj.weight",
        "lm_head.weight",
    ]


def test_split_inverts_fuse_exactly():
    state = expert_state_dict()
    split = split_expert_weights(fuse_expert_weights(state))
    assert set(split) == set(state)
    assert all(torch.equal(split[name], state[name]) for name in state)


def test_split_gives_fp8_experts_their_own_scale_grids():
    """transformers' FP8Experts hold fused FP8 weights beside fused scale grids (gate rows first)."""
    state = expert_state_dict(num_experts=3, intermediate=256, hidden=384)
    quantized, _ = quantize_state_dict(state)
    fused = {
        f"{EXPERTS}.gate_up_proj": torch.stack([torch.cat([quantized[f"{EXPERTS}.{e}.{p}_proj.weight"] for p in ("gate", "up")]) for e in range(3)]),
        f"{EXPERTS}.gate_up_proj_scale_inv": torch.stack([torch.cat([quantized[f"{EXPERTS}.{e}.{p}_proj.weight_scale_inv"] for p in ("gate", "up")]) for e in range(3)]),
        f"{EXPERTS}.down_proj": torch.stack([quantized[f"{EXPERTS}.{e}.down_proj.weight"] for e in range(3)]),
        f"{EXPERTS}.down_proj_scale_inv": torch.stack([quantized[f"{EXPERTS}.{e}.down_proj.weight_scale_inv"] for e in range(3)]),
    }
    split = split_expert_weights(fused)
    assert set(split) == {name for name in quantized if ".experts." in name}
    for name, tensor in split.items():
        assert tensor.dtype == quantized[name].dtype, name
        assert torch.equal(tensor.view(torch.uint8), quantized[name].view(torch.uint8)), name


def test_fuse_rejects_missing_expert_projection():
    state = expert_state_dict()
    del state[f"{EXPERTS}.1.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 expert projections, e.g. \['1.up_proj'\]"):
        fuse_expert_weights(state)


def test_fuse_rejects_fp8_scales():
    quantized, _ = quantize_state_dict(expert_state_dict())
    with pytest.raises(ValueError, match="dequantize_state_dict first"):
        fuse_expert_weights(quantized)


# transformers' Qwen3.5-MoE


def tiny_text_config(**overrides):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    sizes = dict(
        vocab_size=32, hidden_size=256, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, moe_intermediate_size=128, shared_expert_intermediate_size=32,
        num_experts=3, num_experts_per_tok=2, layer_types=["full_attention"],
    )
    return Qwen3_5MoeTextConfig(**{**sizes, **overrides})


def test_fused_layout_is_what_qwen3_5_moe_experts_compute_with():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    config = tiny_text_config(hidden_size=12, moe_intermediate_size=8)
    state = expert_state_dict(num_experts=3, intermediate=8, hidden=12)
    experts = Qwen3_5MoeExperts(config)
    fused = fuse_expert_weights(state)
    experts.load_state_dict(
        {"gate_up_proj": fused[f"{EXPERTS}.gate_up_proj"], "down_proj": fused[f"{EXPERTS}.down_proj"]}
    )
    hidden = torch.randn(4, 12)
    top_k_index = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]])
    top_k_weights = torch.rand(4, 2)
    expected = torch.zeros(4, 12)
    for token in range(4):
        for slot in range(2):
            prefix = f"{EXPERTS}.{int(top_k_index[token, slot])}."
            gate = hidden[token] @ state[prefix + "gate_proj.weight"].T
            up = hidden[token] @ state[prefix + "up_proj.weight"].T
            output = (nn.functional.silu(gate) * up) @ state[prefix + "down_proj.weight"].T
            expected[token] += top_k_weights[token, slot] * output
    # The batched expert path sums in another order than this loop: a float32 rounding apart, while a
    # wrong layout would be off by the size of the outputs themselves.
    torch.testing.assert_close(experts(hidden, top_k_index, top_k_weights), expected, rtol=1e-5, atol=1e-5)


def drama_like_model_class():
    """A custom model (not a transformers class) holding the backbone at `model.language_model`."""
    from transformers import PreTrainedConfig, PreTrainedModel
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel

    class DramaLikeConfig(PreTrainedConfig):
        model_type = "drama_like_test"
        sub_configs = {"text_config": Qwen3_5MoeTextConfig}

        def __init__(self, text_config=None, **kwargs):
            if isinstance(text_config, dict):
                text_config = Qwen3_5MoeTextConfig(**text_config)
            self.text_config = text_config if text_config is not None else Qwen3_5MoeTextConfig()
            super().__init__(**kwargs)

    class Holder(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.language_model = Qwen3_5MoeTextModel(config.text_config)

    class DramaLikeModel(PreTrainedModel):
        config_class = DramaLikeConfig
        base_model_prefix = "model"

        def __init__(self, config):
            super().__init__(config)
            self.model = Holder(config)
            self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
            self.post_init()

    return DramaLikeConfig, DramaLikeModel


@pytest.fixture(scope="module")
def published_checkpoint(tmp_path_factory):
    """A tiny checkpoint in the published layout: per-expert FP8 experts, dense everything else."""
    config_class, model_class = drama_like_model_class()
    config = config_class(text_config=tiny_text_config())
    torch.manual_seed(0)
    state = {name: tensor for name, tensor in model_class(config).state_dict().items() if ".experts." not in name}
    for expert in range(3):
        for projection, shape in (("gate", (128, 256)), ("up", (128, 256)), ("down", (256, 128))):
            state[f"{EXPERTS}.{expert}.{projection}_proj.weight"] = blockwise_weight(*shape, (128, 128), seed=expert)
    quantized, _ = quantize_state_dict(state)
    expected = fuse_expert_weights(dequantize_state_dict(quantized, dtype=torch.float32)[0])

    def write(directory_name, quantization_config, text_model_type="qwen3_5_moe_text"):
        directory = tmp_path_factory.mktemp(directory_name)
        config_dict = config.to_dict()
        config_dict["text_config"]["model_type"] = text_model_type
        config_dict["quantization_config"] = quantization_config
        (directory / "config.json").write_text(json.dumps(config_dict))
        save_file({name: tensor.contiguous() for name, tensor in quantized.items()}, directory / "model.safetensors")
        return directory

    return model_class, expected, write


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA transformers keeps the experts in FP8")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_loads_published_experts_as_fp8_config_dequantized_and_fused(published_checkpoint, dtype):
    model_class, expected, write = published_checkpoint
    directory = write("as_fp8", transformers_quantization_config(PUBLISHED_CONFIG))
    model, info = model_class.from_pretrained(directory, dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    loaded = model.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor.to(dtype)), name


def test_transformers_ignores_bsgemm_moe_and_loads_unscaled_fp8(published_checkpoint):
    model_class, expected, write = published_checkpoint
    model, info = model_class.from_pretrained(write("as_published", PUBLISHED_CONFIG), output_loading_info=True)
    assert any(name.endswith("weight_scale_inv") for name in info["unexpected_keys"])
    assert not torch.allclose(model.state_dict()[f"{EXPERTS}.gate_up_proj"], expected[f"{EXPERTS}.gate_up_proj"])


def test_fish_text_model_type_gets_the_expert_conversion_once_the_package_is_imported(published_checkpoint):
    """transformers maps per-expert names only for its own model types; `import transformers_drama3`
    registers the same conversion for "fish_omni_text", the published backbone's model_type."""
    import transformers_drama3  # noqa: F401

    model_class, expected, write = published_checkpoint
    fp8_config = transformers_quantization_config(PUBLISHED_CONFIG)
    directory = write("fish_text", fp8_config, text_model_type="fish_omni_text")
    model, info = model_class.from_pretrained(directory, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(model.state_dict()[f"{EXPERTS}.gate_up_proj"], expected[f"{EXPERTS}.gate_up_proj"])


def test_cuda_fp8_config_replaces_only_the_routed_experts():
    from transformers.integrations.finegrained_fp8 import FP8Experts, replace_with_fp8_linear

    config_class, model_class = drama_like_model_class()
    quantization_config = fp8_quantization_config_for_cuda()
    assert quantization_config.modules_to_not_convert == [NON_EXPERT_MODULES]
    with torch.device("meta"):
        model = model_class(config_class(text_config=tiny_text_config()))
    dense_linears = sum(type(module) is nn.Linear for module in model.modules())
    replace_with_fp8_linear(model, [NON_EXPERT_MODULES], quantization_config, pre_quantized=True)
    experts = model.model.language_model.layers[0].mlp.experts
    assert isinstance(experts, FP8Experts)
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.gate_up_proj_scale_inv.shape == (3, 2, 2)
    assert sum(type(module) is nn.Linear for module in model.modules()) == dense_linears


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_keeps_experts_in_fp8_and_matches_dequantized_weights(published_checkpoint):
    pytest.importorskip("kernels", reason="transformers' FP8 matmuls come from the `kernels` package")
    model_class, expected, write = published_checkpoint
    directory = write("cuda", transformers_quantization_config(PUBLISHED_CONFIG))
    model = model_class.from_pretrained(directory, dtype=torch.bfloat16, device_map="cuda")
    experts = model.model.language_model.layers[0].mlp.experts
    if experts.gate_up_proj.dtype != FP8_DTYPE:
        pytest.skip("this GPU is below compute capability 8.9: transformers dequantised the experts")
    dense = dequantize_block_fp8(experts.gate_up_proj, experts.gate_up_proj_scale_inv, dtype=torch.float32)
    torch.testing.assert_close(dense.cpu(), expected[f"{EXPERTS}.gate_up_proj"], rtol=0, atol=0)
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    dense_experts = Qwen3_5MoeExperts(tiny_text_config())
    dense_experts.load_state_dict(
        {"gate_up_proj": expected[f"{EXPERTS}.gate_up_proj"], "down_proj": expected[f"{EXPERTS}.down_proj"]}
    )
    hidden = torch.randn(4, 256)
    top_k_index = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]])
    top_k_weights = torch.rand(4, 2)
    reference = dense_experts(hidden, top_k_index, top_k_weights)
    output = experts(hidden.cuda().bfloat16(), top_k_index.cuda(), top_k_weights.cuda().bfloat16()).float().cpu()
    # Dynamic FP8 activations round each input to 3 mantissa bits: a few percent, not more.
    assert (output - reference).norm() <= 0.05 * reference.norm()

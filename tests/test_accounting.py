"""The paper's table (digest §8), computed from the module tree of a meta-device model."""

import pytest

from transformers_drama3.placement.accounting import GB, PAPER_DRAMA3, account, format_table, main
from transformers_drama3.configuration_drama3 import Drama3Config


def tiny_config(**kwargs) -> Drama3Config:
    text = dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, max_position_embeddings=512,
    )
    tower = dict(dim=64, n_head=4, n_local_heads=2, head_dim=16, intermediate_size=96, vocab_size=32,
                 num_codebooks=4, shared_enrichment_layers=2)
    return Drama3Config(text_config=text, audio_decoder_config=tower, semantic_start_token_id=64, eos_token_id=2,
                        **kwargs)


@pytest.fixture(scope="module")
def full_size():
    return account()


def within_10_percent(computed: float, stated: float) -> bool:
    return abs(computed - stated) <= 0.1 * stated


def test_total_parameters_match_the_paper(full_size):
    assert within_10_percent(full_size.total_parameters, PAPER_DRAMA3.total_parameters)


def test_active_parameters_per_token_match_the_paper(full_size):
    assert within_10_percent(full_size.active_parameters_per_token, PAPER_DRAMA3.active_parameters_per_token)


def test_weights_read_per_frame_match_the_paper(full_size):
    assert within_10_percent(full_size.weights_bytes_per_frame / GB, PAPER_DRAMA3.weights_read_per_frame_gb)


def test_backbone_without_routed_experts_per_frame_matches_the_paper(full_size):
    assert within_10_percent(full_size.backbone_bytes_per_frame / GB, PAPER_DRAMA3.backbone_without_routed_experts_gb)


def test_tower_per_frame_matches_the_paper(full_size):
    assert within_10_percent(full_size.tower_bytes_per_frame / GB, PAPER_DRAMA3.tower_gb)


def test_layer_counts_equal_the_paper(full_size):
    assert full_size.sequential_layers_after_backbone == PAPER_DRAMA3.sequential_layers_after_backbone == 13
    assert full_size.growing_kv_cache_layers == PAPER_DRAMA3.growing_kv_cache_layers == 23
    assert (full_size.backbone_full_attention_layers, full_size.backbone_linear_attention_layers) == (10, 30)


def test_tiny_config_counts_equal_a_hand_computation():
    # Backbone layer without routed experts (hidden 64).
    gated_deltanet = (
        (2 * 16 + 32) * 64  # in_proj_qkv: 2 key heads x 8 for q and k, 4 value heads x 8
        + 32 * 64 + 4 * 64 + 4 * 64  # in_proj_z, in_proj_b, in_proj_a
        + 64 * 4 + 4 + 4 + 8  # conv1d [64, 1, 4], dt_bias, A_log, norm
        + 64 * 32  # out_proj
    )
    attention = 2 * 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 16 + 16  # q (+gate), k, v, o, q/k norm
    moe_without_experts = 4 * 64 + 3 * 32 * 64 + 64  # router, shared expert, shared expert gate
    layer_norms = 2 * 64
    backbone = 3 * (gated_deltanet + moe_without_experts + layer_norms) + (
        attention + moe_without_experts + layer_norms
    ) + 64  # final norm
    one_expert = 3 * 32 * 64
    embedding = lm_head = 128 * 64
    # Tower layer besides its code embedding (dim 64, 4 heads, 2 kv heads, head_dim 16, FFN 96).
    tower_layer = (
        2 * 64 + 64 * 128  # enorm, hnorm, eh_proj
        + (2 * 4 + 2 * 2) * 16 * 64 + 64 * 64 + 16 + 16  # wqkv, wo, q/k norm
        + 3 * 96 * 64 + 3 * 64  # SwiGLU, attention_norm, ffn_norm, final_layernorm
    )
    tower_layers, heads = 2 + 3, 3 * 32 * 64
    codebook_table, code_table = 4 * 32 * 64, 32 * 64

    counted = account(tiny_config())

    assert counted.total_parameters == (
        backbone + 4 * 4 * one_expert + embedding + lm_head + tower_layers * (tower_layer + code_table) + heads
        + codebook_table
    )
    assert counted.active_parameters_per_token == backbone + 4 * 2 * one_expert + lm_head
    # One embedding row; lm_head rows of the 32 semantic tokens and eos.
    assert counted.backbone_bytes_per_frame == 2 * (backbone + 64 + (32 + 1) * 64)
    # One row of each layer's code table; codes 1..3 of the shared table.
    assert counted.tower_bytes_per_frame == 2 * (tower_layers * (tower_layer + 64) + heads + 3 * 64)
    # 2 experts x 4 layers in FP8, one float32 scale block for each of gate, up, down.
    assert counted.routed_expert_bytes_per_frame == 4 * 2 * (one_expert + 3 * 4)
    assert counted.sequential_layers_after_backbone == 5
    assert counted.growing_kv_cache_layers == 1 + 5


def test_expert_scales_follow_the_configured_fp8_block():
    quantization = {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    counted = account(tiny_config(quantization_config=quantization))
    # Per expert: gate and up [32, 64] -> 2 x 4 blocks each, down [64, 32] -> 4 x 2 blocks.
    assert counted.routed_expert_scales_per_frame == 4 * 2 * (8 + 8 + 8)


def test_format_table_shows_computed_and_paper_figures(full_size):
    table = format_table(full_size)
    assert "weights read per frame" in table
    assert f"{full_size.weights_bytes_per_frame / GB:.2f} GB" in table
    assert "~6.0 GB" in table and "2.9 GB" in table and "2.1 GB" in table


def test_main_prints_the_table(capsys):
    main()
    assert "layers whose KV cache grows with context" in capsys.readouterr().out

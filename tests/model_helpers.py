"""Tiny Drama 3 configs and checkpoints in the published layout, for tests."""

from __future__ import annotations

import torch

from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration
from transformers_drama3.configuration_drama3 import FIXED_TEXT_SETTINGS

SEMANTIC_START = 64
CODEBOOK_SIZE = 32
EOS = 2
NUM_CODEBOOKS = 4  # the tiny codec's count (codec_helpers.NUM_CODEBOOKS), so models and codec pair


def tiny_text_config(**overrides) -> dict:
    """A published-style `text_config` dict (model_type fish_omni_text), a few KB of weights."""
    config = {
        "model_type": "fish_omni_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": SEMANTIC_START + CODEBOOK_SIZE + 8,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "mlp_layer_types": ["moe"] * 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        **FIXED_TEXT_SETTINGS,
    }
    config.update(overrides)
    return config


def tiny_tower_config(**overrides) -> dict:
    config = {
        "model_type": "fish_qwen3_audio_decoder",
        "decoder_type": "codebook_mtp_shared",
        "dim": 64,
        "text_dim": 64,
        "n_head": 4,
        "n_local_heads": 2,
        "head_dim": 16,
        "n_layer": 2,
        "shared_enrichment_layers": 2,
        "intermediate_size": 96,
        "norm_eps": 1e-6,
        "num_codebooks": NUM_CODEBOOKS,
        "vocab_size": CODEBOOK_SIZE,
        "max_seq_len": NUM_CODEBOOKS + 1,
        "rope_base": 1e7,
        "vq_backbone_codebooks": 1,
    }
    config.update(overrides)
    return config


def tiny_config_dict(text=None, tower=None, **top) -> dict:
    """A tiny `config.json` in the published layout."""
    config = {
        "model_type": "fish_omni",
        "architectures": ["FishOmniModel"],
        "text_config": tiny_text_config(**(text or {})),
        "audio_decoder_config": tiny_tower_config(**(tower or {})),
        "semantic_start_token_id": SEMANTIC_START,
        "semantic_end_token_id": SEMANTIC_START + CODEBOOK_SIZE - 1,
        "eos_token_id": EOS,
        "speech_template_version": "reference-bracket-v1",
        "tie_word_embeddings": False,
    }
    config.update(top)
    return config


def tiny_config(text=None, tower=None, **top) -> Drama3Config:
    return Drama3Config(**tiny_config_dict(text, tower, **top))


def tokenizer_config(tokenizer, codebook_size: int, text=None, tower=None, **top) -> Drama3Config:
    """A tiny config whose ids match a real Drama 3 `tokenizer`: its vocabulary, its
    `<|semantic:0|>` band of `codebook_size` tokens (the tower's codebook size too) and
    `<|im_end|>` as eos. `text`, `tower` and `top` override as in `tiny_config_dict`."""
    start = tokenizer.convert_tokens_to_ids("<|semantic:0|>")
    return tiny_config(
        text={"vocab_size": len(tokenizer), **(text or {})},
        tower={"vocab_size": codebook_size, **(tower or {})},
        semantic_start_token_id=start,
        semantic_end_token_id=start + codebook_size - 1,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        **top,
    )


def tiny_model(seed: int = 0, **config_overrides) -> Drama3ForSpeechGeneration:
    """A float32 tiny model with random (non-trivial) weights, norms included."""
    torch.manual_seed(seed)
    model = Drama3ForSpeechGeneration(tiny_config(**config_overrides)).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                parameter.normal_(0.0, 0.1)  # zero-centred norms: exercise the 1 + w scaling
    return model


def audio_row(codes: list[int]) -> tuple[int, list[int]]:
    """An audio row: the semantic token of code 0, and the frame's codes."""
    return SEMANTIC_START + codes[0], list(codes)


def make_rows(text_ids: list[int], frames: list[list[int]], trailing_text: list[int] = ()):
    """Rows `[text..., audio..., trailing text...]` -> input_ids [1, rows], audio_codes [1, rows, C]."""
    ids, codes = [], []
    for token in text_ids:
        ids.append(token)
        codes.append([0] * NUM_CODEBOOKS)
    for frame in frames:
        main, frame_codes = audio_row(frame)
        ids.append(main)
        codes.append(frame_codes)
    for token in trailing_text:
        ids.append(token)
        codes.append([0] * NUM_CODEBOOKS)
    return torch.tensor([ids]), torch.tensor([codes])


def random_frames(count: int, generator: torch.Generator) -> list[list[int]]:
    return torch.randint(0, CODEBOOK_SIZE, (count, NUM_CODEBOOKS), generator=generator).tolist()


def published_tensor_names(config: Drama3Config, fp8: bool = False) -> set[str]:
    """Every tensor name of a published-layout checkpoint for `config`, written from the spec (§2)."""
    text, tower = config.text_config, config.audio_decoder_config
    names = {"model.language_model.embed_tokens.weight", "model.language_model.norm.weight", "lm_head.weight"}
    for layer, kind in enumerate(text.layer_types):
        prefix = f"model.language_model.layers.{layer}."
        names |= {prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"}
        if kind == "linear_attention":
            names |= {
                prefix + f"linear_attn.{part}"
                for part in (
                    "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                    "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight",
                )
            }
        else:
            names |= {
                prefix + f"self_attn.{part}.weight"
                for part in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
            }
        names |= {prefix + "mlp.gate.weight", prefix + "mlp.shared_expert_gate.weight"}
        names |= {prefix + f"mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        for expert in range(text.num_experts):
            for projection in ("gate_proj", "up_proj", "down_proj"):
                name = prefix + f"mlp.experts.{expert}.{projection}.weight"
                names.add(name)
                if fp8:
                    names.add(name + "_scale_inv")
    names.add("audio_decoder.codebook_embeddings.weight")
    layer_parts = [
        "enorm.weight", "hnorm.weight", "eh_proj.weight",
        "transformer_layer.attention.wqkv.weight", "transformer_layer.attention.wo.weight",
        "transformer_layer.attention.q_norm.weight", "transformer_layer.attention.k_norm.weight",
        "transformer_layer.attention_norm.weight", "transformer_layer.ffn_norm.weight",
        "transformer_layer.feed_forward.w1.weight", "transformer_layer.feed_forward.w2.weight",
        "transformer_layer.feed_forward.w3.weight", "final_layernorm.weight",
    ]
    for layer in range(tower.shared_enrichment_layers):
        prefix = f"audio_decoder_mtp_shared.layers.{layer}."
        names |= {prefix + part for part in layer_parts + ["semantic_embedding.weight"]}
    for layer in range(tower.num_codebooks - 1):
        prefix = f"audio_decoder_mtp.layers.{layer}."
        names |= {prefix + part for part in layer_parts + ["codebook_embedding.weight"]}
        names.add(f"audio_decoder_mtp.heads.{layer}.weight")
    return names

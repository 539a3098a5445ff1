"""Start a Drama 3 model from Qwen3.5-35B-A3B (or any Qwen3.5-MoE checkpoint's language model).

The paper initialises the backbone from Qwen3.5-35B-A3B's language model. This module turns a
Qwen3.5-MoE checkpoint into a `Drama3ForSpeechGeneration`:

- **backbone**: Qwen's text model, unchanged (`model.language_model.*`). The checkpoint is read by
  transformers' own loader (`Qwen3_5MoeForCausalLM.from_pretrained`), so both published layouts
  load: per-expert `mlp.experts.E.{gate,up,down}_proj.weight` and fused
  `mlp.experts.{gate_up_proj,down_proj}`, under `model.language_model.` (the vision-language
  checkpoint) or `model.` (a text-only save). The vision tower (`model.visual.*`) and Qwen's own
  multi-token-prediction layer (`mtp.*`) are dropped.
- **vocabulary**: `embed_tokens` and `lm_head` grow from Qwen's rows to the Drama 3 config's
  `vocab_size`. Qwen's rows are kept as they are; every new row (the 4096 `<|semantic:N|>` tokens
  and any other row past Qwen's vocabulary) starts at the mean of Qwen's rows plus Gaussian noise
  whose per-dimension standard deviation is `noise_scale` times that of Qwen's rows. The mean makes
  a new token look like an average token, both as input and as output: its logit starts near the
  average logit, so the semantic band neither swamps the text distribution nor starts unreachable
  (rows drawn at the usual init scale would give logits unrelated to Qwen's). The noise makes the
  4096 rows distinct, so they do not start as one token repeated.
- **tower**: the Codebook-MTP tower, its heads and `audio_decoder.codebook_embeddings` are new,
  initialised as the model's own `_init_weights` does for a fresh model.

The result is built without a second full-size copy: the Drama 3 model is created on the `meta`
device and takes Qwen's tensors as they are (only the two vocabulary tables are new tensors).

    python -m transformers_drama3.runtime.qwen_init QWEN_DIR OUT_DIR [--eos-token-id ID]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, PretrainedConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from ..configuration_drama3 import FIXED_TEXT_SETTINGS, SEMANTIC_CODEBOOK_SIZE, Drama3Config, Drama3TextConfig
from ..modeling_drama3 import Drama3ForSpeechGeneration

# Sizes and settings that must agree between Qwen's text config and the Drama 3 backbone for Qwen's
# weights to compute the same function (vocab_size is the one size allowed to differ).
ARCHITECTURE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "layer_types",
    "rms_norm_eps",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
ROPE_KEYS = ("rope_theta", "partial_rotary_factor")
IM_END = "<|im_end|>"
DEFAULT_NOISE_SCALE = 0.01


def init_from_qwen3_5_moe(
    qwen: str | os.PathLike | Mapping[str, torch.Tensor] | Qwen3_5MoeForCausalLM,
    drama3_config: Drama3Config,
    *,
    noise_scale: float = DEFAULT_NOISE_SCALE,
    seed: int = 0,
    dtype: torch.dtype | None = None,
) -> Drama3ForSpeechGeneration:
    """Build a Drama 3 model whose backbone is a Qwen3.5-MoE language model (see the module docstring).

    Args:
        qwen: a Qwen3.5-MoE checkpoint directory (or hub id), a state dict in a checkpoint layout
            (`model.language_model.*` or `model.*`, plus `lm_head.weight`), or a loaded
            `Qwen3_5MoeForCausalLM`.
        drama3_config: the Drama 3 config to build. Its `text_config` must match Qwen's architecture
            (`drama3_config_from_qwen` makes one that does); its `vocab_size` may only be larger,
            and the semantic band must lie past Qwen's vocabulary.
        noise_scale: standard deviation of the noise on the new vocabulary rows, relative to the
            per-dimension standard deviation of Qwen's rows.
        seed: seeds the new rows and the tower; the caller's random state is left untouched.
        dtype: dtype of the result; default the checkpoint's.

    Returns:
        `Drama3ForSpeechGeneration` in eval mode, on the device of Qwen's tensors.
    """
    qwen_model = load_qwen3_5_moe_language_model(qwen, drama3_config, dtype)
    qwen_backbone, qwen_config = qwen_model.model, qwen_model.config
    check_backbone_matches(qwen_config, drama3_config)
    qwen_vocab = qwen_config.vocab_size
    new_vocab = drama3_config.text_config.vocab_size
    if drama3_config.semantic_start_token_id < qwen_vocab:
        raise ValueError(
            f"semantic_start_token_id={drama3_config.semantic_start_token_id} lies inside Qwen's "
            f"{qwen_vocab}-row vocabulary; the semantic tokens must be new rows"
        )

    with torch.device("meta"):
        model = Drama3ForSpeechGeneration(drama3_config)
    generator = torch.Generator().manual_seed(seed)
    backbone_state = dict(qwen_backbone.state_dict())
    backbone_state["embed_tokens.weight"] = extend_rows(
        qwen_backbone.embed_tokens.weight.detach(), new_vocab, noise_scale, generator
    )
    model.backbone.load_state_dict(backbone_state, strict=True, assign=True)
    for name, buffer in qwen_backbone.named_buffers():  # RoPE tables: not in the state dict
        owner, _, leaf = name.rpartition(".")
        setattr(model.backbone.get_submodule(owner), leaf, buffer)
    model.lm_head.weight = nn.Parameter(
        extend_rows(qwen_model.lm_head.weight.detach(), new_vocab, noise_scale, generator)
    )
    reference = qwen_backbone.embed_tokens.weight
    initialise_tower(model, reference.device, reference.dtype, seed)
    check_materialised(model)
    return model.eval()


def load_qwen3_5_moe_language_model(
    qwen: str | os.PathLike | Mapping[str, torch.Tensor] | Qwen3_5MoeForCausalLM,
    drama3_config: Drama3Config,
    dtype: torch.dtype | None = None,
) -> Qwen3_5MoeForCausalLM:
    """Qwen's language model, read by transformers' loader (a state dict goes through a temporary
    checkpoint so that the same name conversions apply)."""
    if isinstance(qwen, Qwen3_5MoeForCausalLM):
        return qwen if dtype is None else qwen.to(dtype)
    if isinstance(qwen, Mapping):
        return _load_state_dict(qwen, drama3_config, dtype)
    return Qwen3_5MoeForCausalLM.from_pretrained(qwen, dtype=dtype or "auto")


def _load_state_dict(
    state_dict: Mapping[str, torch.Tensor], drama3_config: Drama3Config, dtype: torch.dtype | None
) -> Qwen3_5MoeForCausalLM:
    embeddings = [key for key in state_dict if key.endswith("embed_tokens.weight")]
    if len(embeddings) != 1:
        raise ValueError(
            f"the Qwen state dict needs exactly one '...embed_tokens.weight'; found {embeddings or 'none'}"
        )
    qwen_config = qwen_text_config(drama3_config.text_config, vocab_size=state_dict[embeddings[0]].shape[0])
    with tempfile.TemporaryDirectory() as directory:
        qwen_config.save_pretrained(directory)
        tensors = {key: tensor.detach().contiguous() for key, tensor in state_dict.items()}
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return Qwen3_5MoeForCausalLM.from_pretrained(directory, dtype=dtype or "auto")


def qwen_text_config(text_config: Drama3TextConfig, vocab_size: int) -> Qwen3_5MoeTextConfig:
    """The stock Qwen3.5-MoE text config with the Drama 3 backbone's architecture."""
    fish_only = {"model_type", "transformers_version", "mlp_layer_types", *FIXED_TEXT_SETTINGS}
    settings = {key: value for key, value in text_config.to_dict().items() if key not in fish_only}
    settings["vocab_size"] = vocab_size
    return Qwen3_5MoeTextConfig(**settings)


def drama3_config_from_qwen(
    qwen_config: PretrainedConfig,
    *,
    eos_token_id: int,
    semantic_start_token_id: int | None = None,
    codebook_size: int = SEMANTIC_CODEBOOK_SIZE,
    **drama3_kwargs,
) -> Drama3Config:
    """A Drama 3 config on Qwen's architecture, with `codebook_size` semantic tokens added.

    `qwen_config` may be the vision-language `Qwen3_5MoeConfig` (its text config is used). The
    semantic band starts at `semantic_start_token_id` (default: right after Qwen's rows) and the
    vocabulary grows to end with it. Other keyword arguments (`audio_decoder_config`, ...) go to
    `Drama3Config`; the default tower follows the backbone's attention shape.
    """
    text = qwen_config.get_text_config()
    start = text.vocab_size if semantic_start_token_id is None else semantic_start_token_id
    settings = {key: value for key, value in text.to_dict().items() if key != "transformers_version"}
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):  # Drama 3 keeps token ids at the top level
        settings.pop(key, None)
    settings.update(model_type="qwen3_5_moe_text", vocab_size=max(text.vocab_size, start + codebook_size))
    tower = drama3_kwargs.pop("audio_decoder_config", None)
    if isinstance(tower, Mapping):
        tower = {"vocab_size": codebook_size, **tower}
    return Drama3Config(
        text_config=settings, audio_decoder_config=tower, semantic_start_token_id=start,
        eos_token_id=eos_token_id, **drama3_kwargs,
    )


def check_backbone_matches(qwen_config: Qwen3_5MoeTextConfig, drama3_config: Drama3Config) -> None:
    """Raise if Qwen's weights would not compute the Drama 3 backbone the config describes."""
    text = drama3_config.text_config
    differences = [
        f"{key}: Qwen {getattr(qwen_config, key)!r}, Drama 3 {getattr(text, key)!r}"
        for key in ARCHITECTURE_KEYS
        if getattr(qwen_config, key) != getattr(text, key)
    ]
    qwen_rope, rope = qwen_config.rope_parameters or {}, text.rope_parameters or {}
    differences += [
        f"rope_parameters.{key}: Qwen {qwen_rope.get(key)!r}, Drama 3 {rope.get(key)!r}"
        for key in ROPE_KEYS
        if qwen_rope.get(key) != rope.get(key)
    ]
    if text.vocab_size < qwen_config.vocab_size:
        differences.append(f"vocab_size: Qwen {qwen_config.vocab_size}, Drama 3 {text.vocab_size} (may only grow)")
    if differences:
        raise ValueError("the Drama 3 text_config does not match the Qwen checkpoint: " + "; ".join(differences))


def extend_rows(
    weight: torch.Tensor, rows: int, noise_scale: float, generator: torch.Generator
) -> torch.Tensor:
    """`weight: [old_rows, dim]` grown to `[rows, dim]`; new rows = mean of the old rows + noise.

    The noise is Gaussian with per-dimension standard deviation `noise_scale` times that of the
    old rows; it is drawn on the CPU from `generator` so a seed gives the same rows on any device.
    """
    old_rows, dim = weight.shape
    reference = weight.float()
    mean, std = reference.mean(dim=0), reference.std(dim=0)
    noise = torch.randn(rows - old_rows, dim, generator=generator).to(weight.device)
    new = mean + noise_scale * std * noise
    return torch.cat((weight, new.to(weight.dtype)))


def initialise_tower(model: Drama3ForSpeechGeneration, device: torch.device, dtype: torch.dtype, seed: int) -> None:
    """Materialise the tower and the codebook embeddings and initialise them as a fresh model does."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for part in (model.audio_decoder, model.audio_decoder_mtp_shared, model.audio_decoder_mtp):
            part.to_empty(device=device)
            for module in part.modules():
                model._init_weights(module)
            part.to(dtype)


def check_materialised(model: nn.Module) -> None:
    left = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if left:
        raise RuntimeError(f"tensors left without values after initialisation from Qwen: {left[:5]}")


def im_end_token_id(qwen_dir: str | os.PathLike) -> int | None:
    """The id of `<|im_end|>` in the checkpoint's tokenizer.json, if it has one."""
    path = Path(qwen_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    for token in json.loads(path.read_text(encoding="utf-8")).get("added_tokens", []):
        if token.get("content") == IM_END:
            return token["id"]
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m transformers_drama3.runtime.qwen_init",
        description="Build a Drama 3 model from a Qwen3.5-MoE checkpoint's language model and save it.",
    )
    parser.add_argument("qwen_dir", help="Qwen3.5-MoE checkpoint directory (e.g. Qwen3.5-35B-A3B)")
    parser.add_argument("out_dir", help="where to save the Drama 3 model")
    parser.add_argument("--eos-token-id", type=int, help=f"id of {IM_END} (default: read from tokenizer.json)")
    parser.add_argument(
        "--semantic-start-token-id", type=int, help="first semantic id (default: right after Qwen's rows)"
    )
    parser.add_argument("--noise-scale", type=float, default=DEFAULT_NOISE_SCALE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), help="default: the checkpoint's")
    args = parser.parse_args(argv)

    eos = args.eos_token_id if args.eos_token_id is not None else im_end_token_id(args.qwen_dir)
    if eos is None:
        parser.error(f"{args.qwen_dir} has no tokenizer.json with {IM_END}; pass --eos-token-id")
    config = drama3_config_from_qwen(
        AutoConfig.from_pretrained(args.qwen_dir),
        eos_token_id=eos,
        semantic_start_token_id=args.semantic_start_token_id,
    )
    model = init_from_qwen3_5_moe(
        args.qwen_dir, config, noise_scale=args.noise_scale, seed=args.seed,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
    )
    model.save_pretrained(args.out_dir)
    print(f"saved Drama 3 ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters) to {args.out_dir}")


if __name__ == "__main__":
    main()

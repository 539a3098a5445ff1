"""Which modules the LoRA presets adapt: shared by training (`training.lora`, through PEFT) and
serving (`serving.adapter_layers`, which serves adapters without PEFT), so a server imports them
without training's dependencies (accelerate, peft, datasets).

- "light": LoRA on the backbone's attention (q/k/v/o), its Gated DeltaNet projections, the shared
  expert, and every tower linear; the tower's codebook heads and the codebook embedding tables are
  trained in full (`full_trained_modules`).
- "heavy": "light" plus LoRA on the routed experts' stacked weights (`EXPERT_PARAMETERS`).
"""

from __future__ import annotations

LIGHT_TARGET_MODULES = (
    r".*\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)"
    r"|linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)"
    r"|shared_expert\.(gate_proj|up_proj|down_proj)"
    r"|eh_proj|attention\.(wqkv|wo)|feed_forward\.(w1|w2|w3))"
)
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
PRESETS = ("light", "heavy")


def full_trained_modules(model) -> list[str]:
    """Names (suffixes) of the modules trained in full: the tower heads and the codebook tables."""
    names = ["codebook_embeddings"]
    names += [f"audio_decoder_mtp.heads.{index}" for index in range(len(model.audio_decoder_mtp.heads))]
    return names

"""LoRA voice fine-tuning: presets, held-out loss on a new voice, merge == unmerged, published names."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from model_helpers import published_tensor_names
from training_helpers import processor, stack_model, voice_examples
from transformers_drama3 import Drama3ForSpeechGeneration
from transformers_drama3.training import TTSCollator, apply_lora, merge_and_save


def held_out_loss(model, batch) -> float:
    model.eval()
    with torch.no_grad():
        return float(model(**batch).loss)


def train(model, batch, steps: int, lr: float) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()


def test_light_preset_targets_and_trains_the_documented_modules():
    model = apply_lora(stack_model(), "light", r=4)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    for part in ("self_attn.q_proj.lora_A", "linear_attn.in_proj_qkv.lora_A", "linear_attn.out_proj.lora_B",
                 "shared_expert.up_proj.lora_A", "attention.wqkv.lora_A", "feed_forward.w2.lora_A", "eh_proj.lora_A",
                 "codebook_embeddings.modules_to_save", "heads.0.modules_to_save"):
        assert any(part in name for name in trainable), part
    assert not any("experts.gate_up_proj" in name or "mlp.gate.weight" in name for name in trainable)


@pytest.mark.slow
def test_lora_learns_a_new_voice_and_merges_exactly(tmp_path):
    proc = processor()
    collator = TTSCollator(proc)
    train_batch = collator(voice_examples(3, 6, frames=10, seed=1))
    held_out = collator(voice_examples(3, 4, frames=10, seed=2))
    model = apply_lora(stack_model(), "light", r=4)
    before = held_out_loss(model, held_out)
    train(model, train_batch, steps=25, lr=5e-3)
    after = held_out_loss(model, held_out)
    assert after < before - 1.0
    with torch.no_grad():
        unmerged = model(**held_out)
    merged = merge_and_save(model, tmp_path / "merged")
    with torch.no_grad():
        merged_output = merged(**held_out)
    torch.testing.assert_close(merged_output.logits, unmerged.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(merged_output.codebook_logits, unmerged.codebook_logits, rtol=1e-4, atol=1e-4)
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert names == published_tensor_names(merged.config)
    reloaded = Drama3ForSpeechGeneration.from_pretrained(tmp_path / "merged").float()
    assert held_out_loss(reloaded, held_out) == pytest.approx(after, rel=1e-4)


def test_heavy_preset_adapts_routed_experts_with_checkpointing():
    model = apply_lora(stack_model(), "heavy", r=2)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any("experts" in name and "lora" in name for name in trainable)
    assert model.get_base_model().is_gradient_checkpointing
    batch = TTSCollator(processor())(voice_examples(0, 2, frames=4))
    model.train()
    model(**batch).loss.backward()
    expert_grads = [p.grad for name, p in model.named_parameters() if "experts" in name and "lora" in name]
    assert any(g is not None and g.abs().sum() > 0 for g in expert_grads)

"""Reward model: Bradley-Terry loss, pair batches, and learning a planted preference with Trainer."""

from __future__ import annotations

import datasets
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

from training_helpers import NUM_CODEBOOKS, RESIDUAL_SIZE, processor, sentence, stack_config, stack_model
from transformers_drama3.training import (
    Drama3ForRewardModeling,
    PreferenceCollator,
    bradley_terry_loss,
    preference_accuracy,
)


def test_bradley_terry_loss_matches_the_paper_formula():
    a, b, y = torch.tensor([1.0, -0.5]), torch.tensor([0.0, 0.5]), torch.tensor([1.0, 0.0])
    expected = (-(y * F.logsigmoid(a - b) + (1 - y) * F.logsigmoid(b - a)) + 1e-3 * (a**2 + b**2)).mean()
    torch.testing.assert_close(bradley_terry_loss(a, b, y), expected)


def take(seed: int, good: bool, frames: int = 4) -> list[list[int]]:
    """A planted preference: good takes use semantic codes 0..15, bad ones 32..47."""
    generator = torch.Generator().manual_seed(seed)
    semantic = torch.randint(0, 16, (frames,), generator=generator) + (0 if good else 32)
    rest = [torch.randint(0, RESIDUAL_SIZE, (frames,), generator=generator) for _ in range(NUM_CODEBOOKS - 1)]
    return torch.stack([semantic, *rest]).tolist()


def pairs(count: int, seed: int) -> list[dict]:
    result = []
    for i in range(count):
        a_good = (i + seed) % 2 == 0
        result.append({
            "prompt": sentence(seed * 100 + i, words=2),
            "take_a": take(seed * 1000 + 2 * i, a_good),
            "take_b": take(seed * 1000 + 2 * i + 1, not a_good),
            "label": 1.0 if a_good else 0.0,
        })
    return result


def test_reward_model_loads_a_speech_checkpoint_and_is_an_auto_class(tmp_path):
    speech = stack_model()
    speech.save_pretrained(tmp_path / "speech")
    reward = Drama3ForRewardModeling.from_pretrained(tmp_path / "speech")
    torch.testing.assert_close(reward.backbone.embed_tokens.weight, speech.backbone.embed_tokens.weight.to(reward.dtype))
    auto = AutoModelForSequenceClassification.from_config(stack_config())
    assert isinstance(auto, Drama3ForRewardModeling)


def test_scores_sit_on_the_take_end_token():
    proc = processor()
    batch = PreferenceCollator(proc)(pairs(2, 0))
    ends = batch["end_positions"]
    im_end = proc.token_ids.id_of("<|im_end|>")
    assert all(int(batch["input_ids"][row, end]) == im_end for row, end in enumerate(ends.tolist()))
    assert batch["input_ids"].shape[0] == 4 and batch["labels"].shape == (2,)


@pytest.mark.slow
def test_reward_model_learns_a_planted_preference(tmp_path):
    proc = processor()
    torch.manual_seed(0)
    model = Drama3ForRewardModeling(stack_config(hidden=32)).float()  # a smaller model of the family
    collator = PreferenceCollator(proc)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=16, learning_rate=5e-3,
        report_to=[], remove_unused_columns=False, use_cpu=True, save_strategy="no", disable_tqdm=True,
        seed=0, lr_scheduler_type="constant", logging_steps=5,
    )
    Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(pairs(32, 1)), data_collator=collator).train()
    assert preference_accuracy(model, collator, pairs(24, 7)) >= 0.9

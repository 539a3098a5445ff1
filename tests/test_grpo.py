"""GRPO: reward shaping, rollout settings and budgets, log-probs, and a planted reward moving the policy."""

from __future__ import annotations

import pytest
import torch

from training_helpers import processor, stack_model
from transformers_drama3.training import GRPOConfig, GRPOTrainer, Prompt, pairwise_advantages, rollout, standardise
from transformers_drama3.training.grpo import ROLLOUT_SETTINGS, policy_log_probs


def test_standardised_rewards_are_clipped_at_three():
    config = GRPOConfig(reward_mean=1.0, reward_std=0.5)
    z = standardise(torch.tensor([1.0, 2.0, 10.0, -10.0]), config)
    assert z.tolist() == [0.0, 2.0, 3.0, -3.0]


def test_pairwise_advantage_is_the_mean_sigmoid_over_the_others():
    z = torch.tensor([0.5, -1.0, 2.0])
    expected = torch.tensor([
        (torch.sigmoid(z[0] - z[1]) + torch.sigmoid(z[0] - z[2])) / 2,
        (torch.sigmoid(z[1] - z[0]) + torch.sigmoid(z[1] - z[2])) / 2,
        (torch.sigmoid(z[2] - z[0]) + torch.sigmoid(z[2] - z[1])) / 2,
    ])
    advantages = pairwise_advantages(z)
    torch.testing.assert_close(advantages, expected)
    assert float(advantages.mean()) == pytest.approx(0.5)  # sigmoid(x) + sigmoid(-x) = 1


def test_rollouts_sample_at_temperature_one_without_truncation():
    assert ROLLOUT_SETTINGS.temperature == 1.0 and ROLLOUT_SETTINGS.top_p == 1.0
    assert ROLLOUT_SETTINGS.top_k is None and not ROLLOUT_SETTINGS.repetition_aware


def prompt_of(text: str, seconds: float = 0.3) -> Prompt:
    rows = processor()(text, return_labels=False)
    return Prompt(rows["input_ids"][0], rows["audio_codes"][0], expected_seconds=seconds)


def test_takes_respect_the_frame_budget_and_log_probs_match_the_full_forward():
    model = stack_model(hidden=32)
    prompt = prompt_of("the cat sat")
    config = GRPOConfig(group_size=4, max_frames=9)  # 2.5 x 0.3 s x 21.5 fps = 17 frames, capped at 9
    takes = rollout(model, prompt.input_ids, prompt.audio_codes, 4, prompt.expected_seconds, config, seed=3)
    assert int(takes.lengths.max()) <= 9
    with torch.no_grad():
        log_probs = policy_log_probs(model, prompt.input_ids, prompt.audio_codes, takes)
    item = int(takes.lengths.argmax())
    frames = takes.frames[item]
    ids = torch.cat((prompt.input_ids, frames[:, 0] + model.config.semantic_start_token_id))
    codes = torch.cat((prompt.audio_codes, frames))
    with torch.no_grad():
        logits = model(ids[None], codes[None], restrict_logits=True).logits[0].log_softmax(-1)
    rows = prompt.input_ids.shape[0]
    tokens = takes.main_ids[item]
    choice = torch.where(tokens == model.config.eos_token_id, logits.shape[-1] - 1,
                         tokens - model.config.semantic_start_token_id)
    expected = logits[torch.arange(rows - 1, rows - 1 + tokens.shape[0]), choice]
    torch.testing.assert_close(log_probs[item], expected, rtol=1e-4, atol=1e-4)


def test_flat_groups_are_dropped_and_the_tower_stays_frozen():
    model = stack_model(hidden=32)
    tower = {n: p.clone() for n, p in model.named_parameters() if n.startswith("audio_decoder")}
    trainer = GRPOTrainer(model, lambda prompt, takes: torch.zeros(len(takes.main_ids)), GRPOConfig(group_size=2))
    stats = trainer.step([prompt_of("hi")])
    assert stats["dropped_groups"] == 1
    assert all(not p.requires_grad for n, p in model.named_parameters() if n.startswith("audio_decoder"))
    assert all(torch.equal(p, tower[n]) for n, p in model.named_parameters() if n in tower)


@pytest.mark.slow
def test_a_preference_for_shorter_takes_shortens_them():
    torch.manual_seed(0)
    model = stack_model(hidden=32)
    prompt = prompt_of("the cat sat")
    config = GRPOConfig(group_size=8, reward_mean=-0.5, reward_std=0.25)

    def mean_length() -> float:
        takes = rollout(model, prompt.input_ids, prompt.audio_codes, 16, prompt.expected_seconds, config, seed=12345)
        return float(takes.lengths.float().mean())

    before = mean_length()
    trainer = GRPOTrainer(model, lambda prompt, takes: -takes.lengths.float() / 17, config, learning_rate=3e-2)
    for step in range(4):
        trainer.step([prompt], seed=step)
    after = mean_length()
    assert after < 0.6 * before

"""GRPO for the backbone's semantic-token policy (digest §7).

One step: for each prompt draw G takes at temperature 1 with no top-p / top-k on the main token
(and no repetition-aware resampling), each at most 2.5x its expected duration and 4096 frames;
score them with a reward function (the preference reward model, or anything else); standardise
`z = clip((s - mu0) / sigma0, -3, 3)` with fixed statistics; advantage
`R_i = mean_{j != i} sigmoid(z_i - z_j)`, centred by its group mean (1/2); drop groups whose reward
std is below 0.05; then one policy-gradient update of `-sum_i (R_i - 1/2) sum_t log pi(a_i,t)`,
normalised by the number of policy tokens, where `a_i,t` are take i's main tokens (semantic tokens
and the final `<|im_end|>`) under the backbone's restricted softmax (semantic band + eos, the same
distribution the sampler drew from). No KL term, no reference model. The Codebook-MTP tower and the
codebook tables are frozen; only the backbone and lm_head learn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..decoding.budget import BUDGET_FACTOR, MAX_FRAMES
from ..decoding.loop import DecodeRun, TakeCollector
from ..decoding.request import RequestOptions, make_sampler, resolve_request
from ..decoding.sampler import SEED_STRIDE, SamplingSettings
from ..modeling_drama3 import positions_from_mask

ROLLOUT_SETTINGS = SamplingSettings(do_sample=True, temperature=1.0, top_p=1.0, top_k=None, repetition_aware=False)
"""Temperature 1, no top-p, no top-k, no RAS on the main token. (The frozen tower's codebook heads
keep the sampler's cap of 30 candidates.)"""


@dataclass
class GRPOConfig:
    """Args:
        group_size: takes per prompt (G; 8 in the paper).
        reward_mean, reward_std: mu0 and sigma0, fixed reward statistics (e.g. of the reward model
            on SFT takes).
        clip: |z| limit (3).
        min_group_std: groups whose raw reward std is below this are dropped (0.05).
        budget_factor, max_frames: frame budget of a take: budget_factor x expected, <= max_frames
            (and never above the paper's 4096 frames).
    """

    group_size: int = 8
    reward_mean: float = 0.0
    reward_std: float = 1.0
    clip: float = 3.0
    min_group_std: float = 0.05
    budget_factor: float = BUDGET_FACTOR
    max_frames: int = MAX_FRAMES


def standardise(scores: torch.Tensor, config: GRPOConfig) -> torch.Tensor:
    """z = clip((s - mu0) / sigma0, -clip, clip)."""
    return ((scores - config.reward_mean) / config.reward_std).clamp(-config.clip, config.clip)


def pairwise_advantages(z: torch.Tensor) -> torch.Tensor:
    """R_i = 1/(n-1) sum_{j != i} sigmoid(z_i - z_j) for one group z: [n] -> [n]."""
    n = z.shape[0]
    pairwise = torch.sigmoid(z[:, None] - z[None, :])
    return (pairwise.sum(dim=1) - pairwise.diagonal()) / (n - 1)


@dataclass
class Takes:
    """G takes of one prompt: main ids [G, steps] (semantic ids, then eos if it ended so),
    frames [G, steps, C], lengths [G] (frames), ended_with_eos [G]."""

    main_ids: list[torch.Tensor]
    frames: list[torch.Tensor]
    eos: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([f.shape[0] for f in self.frames])


@torch.no_grad()
def rollout(model, input_ids: torch.Tensor, audio_codes: torch.Tensor, group_size: int, expected_seconds: float,
            config: GRPOConfig, seed: int | None = None) -> Takes:
    """G takes of one prompt (input_ids [rows], audio_codes [rows, C]) with `ROLLOUT_SETTINGS`."""
    ids = input_ids[None].expand(group_size, -1).to(model.device)
    codes = audio_codes[None].expand(group_size, -1, -1).to(model.device)
    mask = torch.ones_like(ids)
    options = RequestOptions(ROLLOUT_SETTINGS, seed, config.max_frames, float(expected_seconds), config.budget_factor)
    request = resolve_request(model, ids, mask, options)
    collector = TakeCollector(group_size)
    for step in DecodeRun.prefilled(model, ids, codes, mask, make_sampler(model, request), request.budgets).steps_ahead():
        collector.add(step)
    # The policy's tokens are kept as drawn: no click frame is dropped before eos.
    frames = [take.cpu() for take in collector.takes(model.config.num_codebooks)]
    eos = torch.tensor([reason == "eos" for reason in collector.finish_reasons], dtype=torch.bool)
    return Takes(main_ids=[main_tokens(model.config, take, ended) for take, ended in zip(frames, eos.tolist())],
                 frames=frames, eos=eos)


def main_tokens(config, frames: torch.Tensor, ended_with_eos: bool) -> torch.Tensor:
    """The main tokens a take drew: `<|semantic:c0|>` of each frame [frames, C], then eos if it
    ended so. [tokens]."""
    semantic = frames[:, 0] + config.semantic_start_token_id
    eos = torch.tensor([config.eos_token_id] if ended_with_eos else [], dtype=torch.long)
    return torch.cat((semantic, eos))


def policy_log_probs(model, input_ids: torch.Tensor, audio_codes: torch.Tensor, takes: Takes) -> list[torch.Tensor]:
    """Log-probabilities of each take's main tokens under the backbone's restricted softmax.

    The sequence fed is prompt + take frames (right-padded across the group); position
    `rows - 1 + t` predicts main token t. Returns one [tokens] tensor per take (with gradients)."""
    rows = input_ids.shape[0]
    group = len(takes.main_ids)
    longest = max(f.shape[0] for f in takes.frames)
    width = rows + longest
    ids = input_ids.new_zeros(group, width)
    codes = audio_codes.new_zeros(group, width, audio_codes.shape[-1])
    mask = torch.zeros(group, width, dtype=torch.long)
    for item, frames in enumerate(takes.frames):
        n = frames.shape[0]
        ids[item, :rows], codes[item, :rows] = input_ids, audio_codes
        if n:
            ids[item, rows : rows + n] = frames[:, 0] + model.config.semantic_start_token_id
            codes[item, rows : rows + n] = frames
        mask[item, : rows + n] = 1
    device = model.device
    ids, codes, mask = ids.to(device), codes.to(device), mask.to(device)
    hidden = model.backbone(
        inputs_embeds=model.embed_rows(ids, codes), attention_mask=mask,
        position_ids=positions_from_mask(mask), use_cache=False,
    ).last_hidden_state
    log_probs = torch.log_softmax(model.speech_logits(hidden).float(), dim=-1)  # [G, width, band + 1]
    index_of_eos = log_probs.shape[-1] - 1
    result = []
    for item, tokens in enumerate(takes.main_ids):
        tokens = tokens.to(device)
        choice = torch.where(tokens == model.config.eos_token_id, torch.full_like(tokens, index_of_eos),
                             tokens - model.config.semantic_start_token_id)
        positions = torch.arange(rows - 1, rows - 1 + tokens.shape[0], device=device)
        result.append(log_probs[item, positions, choice])
    return result


def freeze_tower(model) -> None:
    """Only the backbone (and lm_head) learn in GRPO."""
    for module in (model.audio_decoder, model.audio_decoder_mtp_shared, model.audio_decoder_mtp):
        module.requires_grad_(False)


@dataclass
class Prompt:
    """One GRPO prompt: rows (input_ids [rows], audio_codes [rows, C], as the processor builds a
    generation prompt, no padding) and the expected duration of its take in seconds."""

    input_ids: torch.Tensor
    audio_codes: torch.Tensor
    expected_seconds: float


RewardFunction = Callable[[Prompt, Takes], torch.Tensor]
"""(prompt, takes) -> raw scores [G] (e.g. the reward model's score of each take)."""


class GRPOTrainer:
    """A minimal GRPO loop: `step(prompts)` rolls out, scores, and updates the policy once.

    Args:
        model: a `Drama3ForSpeechGeneration` (its tower gets frozen).
        reward_fn: see `RewardFunction`.
        optimizer: built over the trainable parameters when None (`build_optimizer(model, "muon")`
            is the paper's choice: constant LR, no weight decay).
    """

    def __init__(self, model, reward_fn: RewardFunction, config: GRPOConfig | None = None, optimizer=None,
                 learning_rate: float = 1e-4):
        self.model = model
        self.reward_fn = reward_fn
        self.config = config or GRPOConfig()
        freeze_tower(model)
        if optimizer is None:
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=learning_rate,
                                          weight_decay=0.0)
        self.optimizer = optimizer

    def step(self, prompts: Sequence[Prompt], seed: int = 0) -> dict:
        config, model = self.config, self.model
        groups = []
        stats = {"groups": len(prompts), "dropped_groups": 0, "mean_reward": 0.0, "mean_length": 0.0}
        for index, prompt in enumerate(prompts):
            model.eval()
            takes = rollout(model, prompt.input_ids, prompt.audio_codes, config.group_size, prompt.expected_seconds,
                            config, seed=seed * SEED_STRIDE + index * config.group_size)
            scores = torch.as_tensor(self.reward_fn(prompt, takes), dtype=torch.float32)
            stats["mean_reward"] += float(scores.mean()) / len(prompts)
            stats["mean_length"] += float(takes.lengths.float().mean()) / len(prompts)
            if float(scores.std()) < config.min_group_std:
                stats["dropped_groups"] += 1
                continue
            advantages = pairwise_advantages(standardise(scores, config))
            groups.append((prompt, takes, advantages - advantages.mean()))
        if not groups:
            stats["loss"] = 0.0
            return stats
        model.train()
        self.optimizer.zero_grad()
        tokens = sum(int(sum(t.shape[0] for t in takes.main_ids)) for _, takes, _ in groups)
        total = 0.0
        for prompt, takes, advantages in groups:
            log_probs = policy_log_probs(model, prompt.input_ids, prompt.audio_codes, takes)
            loss = -sum(a * lp.sum() for a, lp in zip(advantages.tolist(), log_probs)) / tokens
            loss.backward()
            total += loss.item()
        self.optimizer.step()
        stats["loss"] = total
        return stats

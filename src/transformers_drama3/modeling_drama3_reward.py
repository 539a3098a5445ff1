"""The preference reward model of the RL stage: a Drama 3 backbone with a scalar head.

`Drama3ForRewardModeling` is a speech LM of the same family (usually smaller) that reads the full
prompt and a take's audio rows and scores the take's end row; trained with `bradley_terry_loss`
on human pairs. Registered with `AutoModelForSequenceClassification` by `register_auto_classes`;
its data side (`PreferenceCollator`, `preference_accuracy`) is `training/reward.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from .configuration_drama3 import Drama3Config
from .modeling_drama3 import (
    Drama3CodebookEmbeddings,
    Drama3ForSpeechGeneration,
    Drama3Model,
    Drama3PreTrainedModel,
    positions_from_mask,
)

SCORE_REGULARISER = 1e-3


@dataclass
class RewardOutput(ModelOutput):
    """loss: Bradley-Terry + regulariser (with labels); logits: [batch, 1] scores of each take
    (pairs: A takes first, then B takes); accuracy: share of pairs ranked as labelled."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    scores_a: torch.Tensor | None = None
    scores_b: torch.Tensor | None = None


def bradley_terry_loss(scores_a: torch.Tensor, scores_b: torch.Tensor, labels: torch.Tensor,
                       regulariser: float = SCORE_REGULARISER) -> torch.Tensor:
    """Mean over pairs of the BT loss (labels: 1 = A preferred, 0 = B; soft labels allowed)."""
    margin = scores_a - scores_b
    labels = labels.to(margin.dtype)
    nll = -(labels * F.logsigmoid(margin) + (1 - labels) * F.logsigmoid(-margin))
    return (nll + regulariser * (scores_a**2 + scores_b**2)).mean()


class Drama3ForRewardModeling(Drama3PreTrainedModel):
    """Backbone + partial codebook fusion + a scalar `score` head on each take's end row.

    forward(input_ids [n, rows], audio_codes [n, rows, C], attention_mask, end_positions [n],
    labels [pairs]): rows of a pair batch hold the A takes then the B takes (n = 2 * pairs);
    without labels, any n is scored. `end_positions` default to each row's last real row.
    """

    _keys_to_ignore_on_load_unexpected = [r"^lm_head\.", r"^audio_decoder_mtp", r"^mtp\."]

    # The fusion and the semantic band are the speech model's own methods (same attribute names).
    backbone = Drama3ForSpeechGeneration.backbone
    embed_rows = Drama3ForSpeechGeneration.embed_rows
    is_semantic = Drama3ForSpeechGeneration.is_semantic

    def __init__(self, config: Drama3Config):
        super().__init__(config)
        self.model = Drama3Model(config)
        self.audio_decoder = Drama3CodebookEmbeddings(config.audio_decoder_config)
        self.score = nn.Linear(config.hidden_size, 1, bias=False)
        self.backbone_codebooks = config.audio_decoder_config.vq_backbone_codebooks
        self.num_codebooks = config.audio_decoder_config.num_codebooks
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.backbone.embed_tokens

    def forward(self, input_ids, audio_codes=None, attention_mask=None, end_positions=None, labels=None, **kwargs):
        batch, rows = input_ids.shape
        if audio_codes is None:
            audio_codes = input_ids.new_zeros(batch, rows, self.num_codebooks)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.backbone(
            inputs_embeds=self.embed_rows(input_ids, audio_codes),
            attention_mask=attention_mask,
            position_ids=positions_from_mask(attention_mask),
            use_cache=False,
        ).last_hidden_state
        if end_positions is None:
            end_positions = rows - 1 - attention_mask.flip(-1).long().argmax(-1)  # last real row
        scores = self.score(hidden[torch.arange(batch, device=hidden.device), end_positions]).squeeze(-1).float()
        output = RewardOutput(logits=scores[:, None])
        if labels is not None:
            pairs = labels.shape[0]
            if batch != 2 * pairs:
                raise ValueError(f"labels: {pairs} pairs need 2 x {pairs} rows (A takes then B takes); got {batch}")
            output.scores_a, output.scores_b = scores[:pairs], scores[pairs:]
            output.loss = bradley_terry_loss(output.scores_a, output.scores_b, labels)
        return output

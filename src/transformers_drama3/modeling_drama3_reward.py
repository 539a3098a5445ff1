"""The preference reward model of the RL stage: a Drama 3 backbone with a scalar head.

`Drama3ForRewardModeling` is a speech LM of the same family (usually smaller) that reads the full
prompt and a take's audio rows and scores the take's end row; trained with `bradley_terry_loss`
on human pairs. Registered with `AutoModelForSequenceClassification` by `register_auto_classes`;
its data side (`PreferenceCollator`, `preference_accuracy`) is `training/reward.py`.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import Unpack
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput, TransformersKwargs
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import can_return_tuple

from .configuration_drama3 import Drama3Config
from .modeling_drama3 import (
    Drama3CodebookEmbeddings,
    Drama3ForSpeechGeneration,
    Drama3Model,
    Drama3PreTrainedModel,
    check_forward_inputs,
    positions_from_mask,
)

SCORE_REGULARISER = 1e-3


@dataclass
class RewardOutput(ModelOutput):
    """loss: Bradley-Terry + regulariser (with labels); logits: [batch, 1] scores of each take
    (pairs: A takes first, then B takes); cache, hidden_states, attentions: the backbone's, as in
    `Drama3Output` (with `use_cache`, `output_hidden_states`, `output_attentions`); scores_a,
    scores_b: [pairs] the A and B takes' scores (with labels)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
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

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        audio_codes: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        end_positions: torch.LongTensor | None = None,
        labels: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RewardOutput:
        """input_ids [n, rows] (or inputs_embeds [n, rows, hidden]), audio_codes [n, rows, C],
        attention_mask [n, past + rows], end_positions [n] (default: each row's last real row),
        labels [pairs]. `cache`, `use_cache`, `output_hidden_states`, `output_attentions` and
        `return_dict` as in `Drama3ForSpeechGeneration.forward`."""
        if input_ids is None and inputs_embeds is None:
            raise ValueError("forward needs input_ids [batch, rows] or inputs_embeds [batch, rows, hidden]")
        # An int: transformers returns the cache's own length counter, which the forward advances.
        past = 0 if cache is None else int(cache.get_seq_length())
        if not torch.compiler.is_compiling():
            check_forward_inputs(self.config, input_ids, audio_codes, None, None, attention_mask, inputs_embeds, past)
        batch, rows = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if inputs_embeds is None:
            if audio_codes is None:
                audio_codes = input_ids.new_zeros(batch, rows, self.num_codebooks)
            inputs_embeds = self.embed_rows(input_ids, audio_codes)
        if attention_mask is None:
            attention_mask = torch.ones(batch, past + rows, dtype=torch.long, device=inputs_embeds.device)
        outputs = self.model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=positions_from_mask(attention_mask, past),
            cache=cache,
            use_cache=bool(use_cache),
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        if end_positions is None:
            end_positions = rows - 1 - attention_mask[:, past:].flip(-1).long().argmax(-1)  # last real row
        scores = self.score(hidden[torch.arange(batch, device=hidden.device), end_positions]).squeeze(-1).float()
        output = RewardOutput(
            logits=scores[:, None],
            cache=outputs.cache if use_cache else None,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        if labels is not None:
            pairs = labels.shape[0]
            if batch != 2 * pairs:
                raise ValueError(f"labels: {pairs} pairs need 2 x {pairs} rows (A takes then B takes); got {batch}")
            output.scores_a, output.scores_b = scores[:pairs], scores[pairs:]
            output.loss = bradley_terry_loss(output.scores_a, output.scores_b, labels)
        return output

"""The preference reward model of the RL stage (digest §7).

`Drama3ForRewardModeling` is a speech LM of the same family (usually smaller) that reads the full
prompt and a take's audio rows in the published layout and puts a scalar head on the take's end
token (`<|im_end|>` after the take). Trained on human pairs with Bradley-Terry plus a small score
regulariser:

    L = -[ y log s(s_a - s_b) + (1 - y) log s(s_b - s_a) ] + 1e-3 (s_a^2 + s_b^2)

Its backbone and codebook tables have the speech model's names (`model.language_model.*`,
`audio_decoder.codebook_embeddings`), so `from_pretrained` of a speech checkpoint loads them and
initialises only the `score` head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForSequenceClassification
from transformers.utils import ModelOutput

from ..configuration_drama3 import Drama3Config
from ..modeling_drama3 import (
    Drama3CodebookEmbeddings,
    Drama3ForSpeechGeneration,
    Drama3Model,
    Drama3PreTrainedModel,
    positions_from_mask,
)
from ..prompting import Reference, Script
from .collators import as_codes

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


def register_reward_model() -> None:
    """Make `AutoModelForSequenceClassification.from_pretrained` build `Drama3ForRewardModeling` for
    Drama 3 configs (its output is one score per row, as a 1-label classifier). Idempotent;
    `import transformers_drama3.training` calls it. Everything else is registered by
    `transformers_drama3.register_auto_classes`, which cannot import the training code."""
    AutoModelForSequenceClassification.register(Drama3Config, Drama3ForRewardModeling, exist_ok=True)


class PreferenceCollator:
    """Preference pairs -> a reward-model batch.

    Each example: `prompt` (text, or a `Script` without target), `take_a` and `take_b` (codes
    [num_codebooks][frames]), `label` (1 if A is preferred, 0 if B; soft values allowed) and
    optional `references` ([{"text", "codes", "speaker"}]). Rows are right-padded; A rows first.
    """

    def __init__(self, processor):
        self.processor = processor

    def take_rows(self, example: dict, take) -> tuple:
        references = [
            Reference(r["text"], as_codes(r["codes"]), speaker=int(r.get("speaker", 0)))
            for r in example.get("references") or ()
        ]
        prompt = example["prompt"]
        script = Script(lines=prompt, references=references, target=as_codes(take)) if isinstance(prompt, str) else (
            Script(prompt.lines, prompt.references, prompt.history, prompt.instruction, as_codes(take), prompt.strict_speakers)
        )
        rows = self.processor.rows(script)
        end = int(rows.supervised.nonzero().flatten()[-1])  # the take's closing <|im_end|>
        return rows, end

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        built = [self.take_rows(e, e["take_a"]) for e in examples] + [self.take_rows(e, e["take_b"]) for e in examples]
        batch = dict(self.processor.pad([rows for rows, _ in built], return_labels=False, padding_side="right"))
        batch["end_positions"] = torch.tensor([end for _, end in built])
        batch["labels"] = torch.tensor([float(e["label"]) for e in examples])
        return batch


def preference_accuracy(model, collator: PreferenceCollator, examples: Sequence[dict], batch_size: int = 8) -> float:
    """Share of pairs whose preferred take gets the higher score."""
    correct = 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            chunk = list(examples[start : start + batch_size])
            batch = collator(chunk)
            labels = batch.pop("labels")
            scores = model(**batch).logits[:, 0]
            pairs = len(chunk)
            prefers_a = scores[:pairs] > scores[pairs:]
            correct += int((prefers_a == (labels > 0.5)).sum())
    return correct / len(examples)

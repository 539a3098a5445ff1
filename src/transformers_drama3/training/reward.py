"""The preference reward model of the RL stage (digest §7).

`Drama3ForRewardModeling` is a speech LM of the same family (usually smaller) that reads the full
prompt and a take's audio rows in the published layout and puts a scalar head on the take's end
token (`<|im_end|>` after the take). Trained on human pairs with Bradley-Terry plus a small score
regulariser:

    L = -[ y log s(s_a - s_b) + (1 - y) log s(s_b - s_a) ] + 1e-3 (s_a^2 + s_b^2)

Its backbone and codebook tables have the speech model's names (`model.language_model.*`,
`audio_decoder.codebook_embeddings`), so `from_pretrained` of a speech checkpoint loads them and
initialises only the `score` head. The model is in `modeling_drama3_reward` (registered with
`AutoModelForSequenceClassification` by `register_auto_classes`); this module holds its data side.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..modeling_drama3_reward import (  # noqa: F401  (the model has its own module; training uses it from here too)
    SCORE_REGULARISER,
    Drama3ForRewardModeling,
    RewardOutput,
    bradley_terry_loss,
)
from ..prompting import Reference, Script
from .collators import as_codes


class PreferenceCollator:
    """Preference pairs -> a reward-model batch.

    Each example: `prompt` (text, or a `Script` without target), `take_a` and `take_b` (codes
    `[num_codebooks][frames]`), `label` (1 if A is preferred, 0 if B; soft values allowed) and
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

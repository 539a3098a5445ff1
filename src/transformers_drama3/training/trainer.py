"""`Drama3Trainer`: `transformers.Trainer` plus two small things the collators can ask for.

Plain `Trainer` already trains `Drama3ForSpeechGeneration` (the model returns `loss`; pass
`remove_unused_columns=False` so the collator receives the prepared columns). This subclass adds:

- `optimizer="muon"`: `MuonWithAdamW` (see optim.py) instead of the default AdamW;
- packed batches (`document_ids`): unpacked to one row per document before the forward, which
  is exact whatever the backbone's kernels (see packing.py).

Resuming needs nothing special: checkpoints are written in the published layout and the model's
`load_state_dict` reads that layout back.
"""

from __future__ import annotations

from transformers import Trainer

from .optim import build_optimizer
from .packing import is_packed, unpack


def drama3_loss(model, inputs: dict, pad_id: int = 0):
    """(loss, output) of one batch: unpacks packed batches; `row_weights` go to the model's forward."""
    inputs = dict(inputs)
    if is_packed(inputs):
        inputs = unpack(inputs, pad_id)
    output = model(**inputs)
    return output.loss, output


class Drama3Trainer(Trainer):
    """`Trainer` with `optimizer="adamw"|"muon"` and support for packed and weighted batches.

    Args:
        optimizer: which optimiser `create_optimizer` builds ("adamw" or "muon"); ignored when
            `optimizers=(...)` is given.
        pad_id: padding id used when unpacking packed batches.
        (everything else as `transformers.Trainer`)
    """

    def __init__(self, *args, optimizer: str = "adamw", pad_id: int = 0, **kwargs):
        self.optimizer_name = optimizer
        self.pad_id = pad_id
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = build_optimizer(
                model if model is not None else self.model,
                self.optimizer_name,
                lr=self.args.learning_rate,
                weight_decay=self.args.weight_decay,
            )
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, output = drama3_loss(model, inputs, self.pad_id)
        return (loss, output) if return_outputs else loss

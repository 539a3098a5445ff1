"""`Drama3Trainer`: `transformers.Trainer` plus two small things.

Plain `Trainer` already trains `Drama3ForSpeechGeneration` (the model returns `loss`; pass
`remove_unused_columns=False` so the collator receives the prepared columns), packed batches from
`PackingCollator` included: the model's forward takes their `document_ids` and masks each document
from the others. This subclass adds:

- `optimizer="muon"`: `MuonWithAdamW` (see optim.py) instead of the default AdamW;
- packed batches for a backbone loaded with a flash-attention implementation, which takes no 4-D
  mask and so cannot keep documents apart: those batches are unpacked to one row per document
  before the forward (exact, without packing's savings). Every other backbone gets them packed.

Resuming needs nothing special: checkpoints are written in the published layout and the model's
`load_state_dict` reads that layout back (under FSDP, as accelerate's sharded checkpoints).

Under `accelerate launch` with an FSDP config the model is sharded by accelerate (FSDP2); on CPU
processes too (`distributed.shard_on_cpu`), so the sharded path can be tested without a GPU. A
DeepSpeed config (ZeRO-3) runs on CPU processes as it is, given `use_cpu=True`; without it, on a
machine with no GPU, accelerate counts one process while DeepSpeed counts all of them, which
`check_deepspeed_world_size` refuses with a message instead of DeepSpeed's batch-size assertion.
"""

from __future__ import annotations

import torch.distributed as dist
from accelerate.utils import DistributedType
from transformers import Trainer
from transformers.modeling_utils import unwrap_model
from transformers.utils.generic import is_flash_attention_requested

from .distributed import shard_on_cpu
from .optim import build_optimizer
from .packing import is_packed, unpack


def masks_documents(model) -> bool:
    """Whether `model`'s forward can take packed rows (`document_ids`): every backbone attention
    implementation but flash attention, which takes no 4-D mask."""
    config = unwrap_model(model).config
    return not is_flash_attention_requested(getattr(config, "text_config", config))


def check_deepspeed_world_size(args) -> None:
    """Refuse a DeepSpeed launch whose process count accelerate got wrong.

    On a machine without GPUs and without `use_cpu`, accelerate 1.16 finds no process-group backend
    of its own and counts one process (`args.world_size == 1`), while DeepSpeed's own group (its CPU
    accelerator, gloo) holds all of them; transformers fills DeepSpeed's `train_batch_size` from the
    former and `deepspeed.initialize` then fails its batch check. With `use_cpu=True` accelerate
    starts a gloo group over all the processes and DeepSpeed runs on it."""
    state = getattr(args, "distributed_state", None)
    if state is None or state.distributed_type != DistributedType.DEEPSPEED or not dist.is_initialized():
        return
    if state.num_processes != dist.get_world_size():
        raise ValueError(
            f"DeepSpeed runs {dist.get_world_size()} processes but accelerate counts {state.num_processes} "
            f"(no GPU on this machine): pass use_cpu=True in TrainingArguments (examples/train.py: --cpu)")


def drama3_loss(model, inputs: dict, pad_id: int = 0):
    """(loss, output) of one batch. Packed batches go to the model as they are, unless its backbone
    uses flash attention (then they are unpacked with `pad_id`); `row_weights` go to the forward."""
    inputs = dict(inputs)
    if is_packed(inputs) and not masks_documents(model):
        inputs = unpack(inputs, pad_id)
    output = model(**inputs)
    return output.loss, output


class Drama3Trainer(Trainer):
    """`Trainer` with `optimizer="adamw"|"muon"`, and packed batches for flash-attention backbones.

    Args:
        optimizer: which optimiser `create_optimizer` builds ("adamw" or "muon"); ignored when
            `optimizers=(...)` is given.
        pad_id: padding id used when a packed batch must be unpacked (flash-attention backbones).

    Every other argument is `transformers.Trainer`'s.
    """

    def __init__(self, *args, optimizer: str = "adamw", pad_id: int = 0, **kwargs):
        self.optimizer_name = optimizer
        self.pad_id = pad_id
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        check_deepspeed_world_size(self.args)
        super().create_accelerator_and_postprocess()
        if shard_on_cpu(self.accelerator):
            self.is_fsdp_enabled = True

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

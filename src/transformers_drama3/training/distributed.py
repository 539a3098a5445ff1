"""Training across processes with accelerate's FSDP2: the CPU proof, and saving the published layout.

The sharding is accelerate's and torch's (`accelerate launch --config_file
examples/accelerate/fsdp2_*.yaml`: `fully_shard` on each backbone decoder layer and tower layer);
this module adds two things around it:

- `shard_on_cpu`: accelerate 1.16 turns FSDP on only for GPU-like devices (its state picks FSDP
  for MULTI_GPU / XPU / NPU / ... and keeps a CPU run MULTI_CPU, i.e. DDP), while torch's
  `fully_shard` itself runs on a CPU mesh with gloo. When the launcher asked for FSDP
  (`ACCELERATE_USE_FSDP=true`, set by `accelerate launch` from the config) and the processes run
  on CPUs (`--cpu` / `use_cpu`), the accelerator is switched to accelerate's FSDP path with the
  plugin built from the same environment, so a CPU machine runs exactly the code a GPU node runs
  (the equivalence tests in tests/test_fsdp_training.py rely on this).
- `save_sharded_model`: the full state dict gathered from the shards (on the main process, in CPU
  memory) is written by the model's own `save_pretrained`: the published layout, per-expert names,
  block-FP8 experts re-quantised only where they changed since loading.
"""

from __future__ import annotations

import os

from accelerate import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin


def fsdp_requested() -> bool:
    """Whether the launcher asked for FSDP (`accelerate launch` with a `distributed_type: FSDP` config)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def shard_on_cpu(accelerator) -> bool:
    """Switch a CPU multi-process `accelerator` (MULTI_CPU, gloo) to FSDP when the launcher asked
    for it. Returns whether it did. The plugin reads the launcher's FSDP_* environment, as
    accelerate's own state does on a GPU."""
    state = accelerator.state
    if not fsdp_requested() or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin()
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    # AcceleratorState copies PartialState's fields each time it is constructed again (Trainer and
    # accelerate do so later): switch both, as accelerate's own state does on a GPU
    PartialState().distributed_type = DistributedType.FSDP
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    return True


def is_sharded(trainer) -> bool:
    return getattr(trainer.accelerator.state, "fsdp_plugin", None) is not None


def sharding_summary(trainer) -> str:
    """One line: how many of the model's parameter elements this process holds."""
    from torch.distributed.tensor import DTensor

    held = total = 0
    for parameter in trainer.model.parameters():
        total += parameter.numel()
        held += parameter.to_local().numel() if isinstance(parameter, DTensor) else parameter.numel()
    plugin = trainer.accelerator.state.fsdp_plugin
    return (f"FSDP{plugin.fsdp_version} over {trainer.accelerator.num_processes} processes: this process holds "
            f"{held} of {total} parameter elements")


def save_sharded_model(trainer, directory: str | os.PathLike) -> list[str] | None:
    """Gather the full state dict of an FSDP-trained model and save it in the published layout.

    Every process must call this (the gather is a collective); only the main process writes.
    Returns, on the main process, the routed expert weights re-quantised (changed since loading).
    """
    from transformers.modeling_utils import unwrap_model

    state_dict = trainer.accelerator.get_state_dict(trainer.model)  # full tensors, main process, CPU
    model = unwrap_model(trainer.model)
    quantized = None
    if trainer.is_world_process_zero():
        quantized = model.save_pretrained(directory, state_dict=state_dict)
    trainer.accelerator.wait_for_everyone()
    return quantized

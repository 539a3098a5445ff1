"""GPU memory per process of a full fine-tune sharded by an accelerate config (FSDP2 or ZeRO-3).

Counted from the model built on the meta device and the config file, per GPU:

- sharded state, divided by the process count: float32 master weights (4 bytes a parameter),
  float32 gradients (4), optimiser state (AdamW: 8; Muon's momentum: 4 for the 2-D hidden
  matrices, see `optim.is_muon_parameter`); with ZeRO-3 and bf16 also the partitioned bf16 weights (2);
- gathered working set (bf16 when mixed precision is bf16, else float32): the largest wrap unit
  twice (the unit that runs and the next, prefetched), plus its unsharded gradient; the root
  unit's leftovers (modules in no wrap unit) stay gathered for the whole step;
- activations kept by activation checkpointing: each checkpointed layer's input,
  `tokens x hidden x 2 bytes` (bf16), for the backbone's and the tower's layers.

Not counted: the recompute peak inside one layer, the CUDA context and allocator slack, the
collectives' buffers. `python -m transformers_drama3.training.memory_estimate CONFIG.yaml ...` prints the
table that docs/scale_out.md shows.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from ..configuration_drama3 import Drama3Config
from ..modeling_drama3 import Drama3ForSpeechGeneration
from ..placement.planning import published_config
from .optim import is_muon_parameter

GB = 1e9


@dataclass
class TrainingMemory:
    config_file: str
    processes: int
    optimizer: str
    sharded_state: float  # bytes per GPU
    gathered: float
    activations: float

    @property
    def total(self) -> float:
        return self.sharded_state + self.gathered + self.activations

    def row(self) -> str:
        return (f"| {self.config_file} | {self.processes} | {self.optimizer} | {self.sharded_state / GB:.1f} GB | "
                f"{self.gathered / GB:.1f} GB | {self.activations / GB:.1f} GB | {self.total / GB:.1f} GB |")


def read_launch_config(path: str):
    """accelerate's own reader of a `--config_file` (the fields `accelerate launch` uses)."""
    return load_config_from_file(path)


def training_memory(
    config_file: str,
    model_config: Drama3Config | None = None,
    optimizer: str = "adamw",
    tokens_per_gpu: int = 4096,
) -> TrainingMemory:
    """Bytes per GPU for `config_file` (a shipped accelerate config) training `model_config`
    (default: the published model's shape) with `optimizer`, `tokens_per_gpu` rows per micro-batch."""
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer must be 'adamw' or 'muon'; got {optimizer!r}")
    launch = read_launch_config(config_file)
    processes = int(launch.num_processes)
    compute_bytes = 2 if launch.mixed_precision == "bf16" else 4
    config = model_config or published_config()
    with torch.device("meta"):
        model = Drama3ForSpeechGeneration(config)

    state = 0
    for name, parameter in model.named_parameters():
        optimizer_bytes = 4 if optimizer == "muon" and is_muon_parameter(name, parameter) else 8
        per_parameter = 4 + 4 + optimizer_bytes
        if launch.distributed_type == DistributedType.DEEPSPEED:
            per_parameter += compute_bytes  # ZeRO-3 keeps the partitioned compute-dtype weights too
        state += parameter.numel() * per_parameter
    sharded_state = state / processes

    units = [layer for layer in model.backbone.layers] + list(model.tower_layers)
    unit_parameters = max(sum(p.numel() for p in unit.parameters()) for unit in units)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    leftovers = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    gathered = (3 * unit_parameters + 2 * leftovers) * compute_bytes

    hidden = config.text_config.hidden_size
    checkpointed = len(model.backbone.layers) + len(model.tower_layers)
    activations = tokens_per_gpu * hidden * 2 * checkpointed
    return TrainingMemory(config_file, processes, optimizer, sharded_state, gathered, activations)


HEADER = ("| config | GPUs | optimiser | sharded state | gathered units | checkpointed activations | total |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")


def main(argv: list[str] | None = None) -> None:
    files = (argv if argv is not None else sys.argv[1:])
    print(HEADER)
    for file in files:
        for optimizer in ("adamw", "muon"):
            if "deepspeed" in file and optimizer == "muon":
                continue
            print(training_memory(file, optimizer=optimizer).row())


if __name__ == "__main__":
    main()

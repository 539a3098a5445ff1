"""Run by tests/test_fsdp_training.py under torch.distributed.run (2 gloo processes): Muon on
parameters sharded like FSDP2 shards them (DTensor, rows split over the ranks) against torch's Muon
on the whole matrices with the same gradients. Writes {name: max abs difference} as JSON (rank 0)."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from transformers_drama3.training.optim import GatheringMuon

# uneven rows (5, 7) put unequal blocks on the two ranks; (8, 6) and (7, 5) take Muon's transposed branch
SHAPES = [(6, 8), (8, 6), (5, 7), (7, 5), (64, 128)]
STEPS = 3


def run(optimizer_class, sharded: bool, mesh) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(STEPS)]
    place = (lambda t: distribute_tensor(t, mesh, [Shard(0)])) if sharded else (lambda t: t)
    parameters = [torch.nn.Parameter(place(w.clone())) for w in weights]
    optimizer = optimizer_class(parameters, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(STEPS):
        for parameter, grad in zip(parameters, grads[step]):
            parameter.grad = place(grad.clone())
        optimizer.step()
    return [p.detach().full_tensor() if sharded else p.detach() for p in parameters]


def main(output: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    whole = run(torch.optim.Muon, sharded=False, mesh=mesh)
    gathered = run(GatheringMuon, sharded=True, mesh=mesh)
    torch_on_shards = run(torch.optim.Muon, sharded=True, mesh=mesh)
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in SHAPES]
    if dist.get_rank() == 0:
        report = {
            "gathered": [(a - b).abs().max().item() for a, b in zip(gathered, whole)],
            "torch_on_shards": [(a - b).abs().max().item() for a, b in zip(torch_on_shards, whole)],
            "moved": [(w - w0).abs().max().item() for w, w0 in zip(whole, initial)],
        }
        with open(output, "w") as handle:
            json.dump(report, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

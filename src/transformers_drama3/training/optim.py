"""Optimisers: AdamW, or Muon for the hidden matrices with AdamW for everything else (stage 3, RL).

Muon (`torch.optim.Muon`) orthogonalises the update of 2-D weight matrices; it is meant for the
hidden layers only. Embeddings (`embed_tokens`, the codebook embedding tables), output heads
(`lm_head`, the tower's codebook heads), norms, biases, gates' 1-D parameters and the routed
experts' 3-D stacked weights go to AdamW (torch's Muon takes 2-D parameters only).

Sharded parameters (FSDP2's DTensors, each rank holding a block of rows): Newton-Schulz
orthogonalises the whole matrix, so a rank cannot orthogonalise its own rows alone, and running
torch's Muon on the DTensor lets each matmul of the iteration reduce partial bfloat16 products
across ranks in another order than one process does (updates off by up to 3% of an entry, measured
on 2 ranks). `GatheringMuon` gathers each matrix's momentum-mixed update (one all-gather per
matrix), orthogonalises it exactly as one process does, and keeps this rank's rows: a sharded run
steps like a single process.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

EMBEDDINGS_AND_HEADS = (
    "embed_tokens",
    "lm_head",
    "codebook_embeddings",
    "semantic_embedding",
    "codebook_embedding",
    "audio_decoder_mtp.heads",
    "score",
    "modules_to_save",
)


def is_muon_parameter(name: str, parameter: torch.Tensor) -> bool:
    """A 2-D hidden matrix (not an embedding table nor an output head)."""
    return parameter.ndim == 2 and not any(part in name for part in EMBEDDINGS_AND_HEADS)


def split_parameters(model: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Trainable parameters as (muon, adamw) lists of (name, parameter)."""
    muon, adamw = [], []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (muon if is_muon_parameter(name, parameter) else adamw).append((name, parameter))
    return muon, adamw


class GatheringMuon(torch.optim.Muon):
    """`torch.optim.Muon`, and for sharded (DTensor) parameters the same step on the gathered matrix.

    Plain tensors take torch's own step. For a DTensor parameter the momentum buffer stays sharded
    like the parameter (its update is elementwise); the update `grad.lerp(buf, momentum)` (Nesterov)
    or `buf` is gathered, orthogonalised by torch's Newton-Schulz on the full matrix, and this
    rank's rows of the result are applied with the learning rate torch adjusts by the full shape.
    """

    @torch.no_grad()
    def step(self, closure=None):
        sharded = [group for group in self.param_groups if any(isinstance(p, DTensor) for p in group["params"])]
        if not sharded:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                if isinstance(parameter, DTensor):
                    self._step_sharded(parameter, group)
                else:
                    self._step_plain(parameter, group)
        return loss

    def _momentum_update(self, parameter: torch.Tensor, group: dict) -> torch.Tensor:
        grad = parameter.grad
        state = self.state[parameter]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer

    def _apply(self, parameter: torch.Tensor, orthogonal: torch.Tensor, group: dict) -> None:
        lr = group["lr"]
        parameter.mul_(1 - lr * group["weight_decay"])
        parameter.add_(orthogonal, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], parameter.shape))

    def _orthogonal(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        return _zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])

    def _step_plain(self, parameter: torch.Tensor, group: dict) -> None:
        self._apply(parameter, self._orthogonal(self._momentum_update(parameter, group), group), group)

    def _step_sharded(self, parameter: DTensor, group: dict) -> None:
        full = self._momentum_update(parameter, group).full_tensor()  # [rows, columns], every rank
        orthogonal = self._orthogonal(full, group)
        # every rank holds the same full result: keep this rank's block without communication
        local = distribute_tensor(orthogonal, parameter.device_mesh, parameter.placements, src_data_rank=None)
        self._apply(parameter, local, group)


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimiser object (what `Trainer` and LR schedulers expect) driving `torch.optim.Muon`
    on the hidden matrices and `torch.optim.AdamW` on the rest. `param_groups` is the two
    optimisers' groups, so a scheduler scales both learning rates together.

    Args:
        muon_parameters, adamw_parameters: lists of parameters.
        lr: Muon learning rate; adamw_lr: AdamW learning rate (defaults to `lr`).
        weight_decay: for both (the RL recipe uses 0).
        adjust_lr_fn: torch Muon's per-shape LR rule; "match_rms_adamw" lets Muon share AdamW's LR
            scale.
    """

    def __init__(
        self,
        muon_parameters: Iterable[torch.Tensor],
        adamw_parameters: Iterable[torch.Tensor],
        lr: float = 1e-3,
        adamw_lr: float | None = None,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        adjust_lr_fn: str | None = "match_rms_adamw",
    ):
        muon_parameters, adamw_parameters = list(muon_parameters), list(adamw_parameters)
        self.optimizers: list[torch.optim.Optimizer] = []
        if muon_parameters:
            self.optimizers.append(
                GatheringMuon(
                    muon_parameters, lr=lr, weight_decay=weight_decay, momentum=momentum, adjust_lr_fn=adjust_lr_fn
                )
            )
        if adamw_parameters:
            self.optimizers.append(
                torch.optim.AdamW(adamw_parameters, lr=adamw_lr or lr, betas=betas, weight_decay=weight_decay)
            )
        if not self.optimizers:
            raise ValueError("MuonWithAdamW: no trainable parameters")
        super().__init__(muon_parameters + adamw_parameters, {"lr": lr})
        self.param_groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    # The state dict has torch's usual form ({"state": {index: ...}, "param_groups": [...]}, indices
    # counted over all groups in order), which torch.distributed.checkpoint's optimizer state dict
    # (FSDP2 checkpoints through accelerate) maps to parameter names.

    def load_state_dict(self, state_dict) -> None:
        if "optimizers" in state_dict:  # the earlier form: one state dict per child optimiser
            for optimizer, state in zip(self.optimizers, state_dict["optimizers"]):
                optimizer.load_state_dict(state)
        else:
            groups = iter(state_dict["param_groups"])
            for optimizer in self.optimizers:
                own = [next(groups) for _ in optimizer.param_groups]
                indices = {index for group in own for index in group["params"]}
                state = {index: value for index, value in state_dict["state"].items() if index in indices}
                optimizer.load_state_dict({"state": state, "param_groups": own})
        self.param_groups = [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self):
        merged = {}
        for optimizer in getattr(self, "optimizers", []):
            merged.update(optimizer.state)
        return merged

    @state.setter
    def state(self, value):  # torch.optim.Optimizer.__init__ assigns it; the children own the state
        pass


def build_optimizer(
    model: nn.Module, name: str = "adamw", lr: float = 1e-4, weight_decay: float = 0.0, adamw_lr: float | None = None
) -> torch.optim.Optimizer:
    """"adamw": AdamW on every trainable parameter; "muon": `MuonWithAdamW` split by `split_parameters`."""
    if name == "adamw":
        parameters = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(parameters, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    if name == "muon":
        muon, adamw = split_parameters(model)
        return MuonWithAdamW(
            [p for _, p in muon], [p for _, p in adamw], lr=lr, adamw_lr=adamw_lr, weight_decay=weight_decay
        )
    raise ValueError(f"optimizer must be 'adamw' or 'muon'; got {name!r}")

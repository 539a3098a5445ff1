"""Optimisers: AdamW, or Muon for the hidden matrices with AdamW for everything else (stage 3, RL).

Muon (`torch.optim.Muon`) orthogonalises the update of 2-D weight matrices; it is meant for the
hidden layers only. Embeddings (`embed_tokens`, the codebook embedding tables), output heads
(`lm_head`, the tower's codebook heads), norms, biases, gates' 1-D parameters and the routed
experts' 3-D stacked weights go to AdamW (torch's Muon takes 2-D parameters only).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

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
                torch.optim.Muon(
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

    def state_dict(self):
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict) -> None:
        for optimizer, state in zip(self.optimizers, state_dict["optimizers"]):
            optimizer.load_state_dict(state)
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

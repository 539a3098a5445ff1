"""Routed experts one linear per expert projection, so that transformers' weight quantisers reach them.

transformers' Qwen3.5-MoE holds the routed experts of a layer as two fused 3-D parameters
(`mlp.experts.gate_up_proj: [E, 2I, H]`, `mlp.experts.down_proj: [E, H, I]`). torchao's and
bitsandbytes' quantisers convert `nn.Linear` modules only, so they skip them, and the experts are
about 32B of the published model's 35B parameters. `Drama3RoutedExperts` holds the same weights as
`E` small SwiGLU modules whose linears carry the published checkpoint's own names:

    mlp.experts.E.gate_proj: Linear(H -> I)   mlp.experts.E.up_proj: Linear(H -> I)
    mlp.experts.E.down_proj: Linear(I -> H)

and computes what `Qwen3_5MoeExperts` computes (each routed row through its top-k experts, weighted
by the router). A quantiser then converts each expert's linears as it converts any other linear,
and loading fills (and quantises) them one expert at a time, never a whole fused layer.

The layout is chosen when the model is built: `split_routed_experts` inside `Drama3ForSpeechGeneration`
while `routed_experts_split()` is active (the quantised `from_pretrained`, `quantized_loading.py`).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn
from transformers.activations import ACT2FN


_SPLIT_REQUESTED = contextvars.ContextVar("drama3_split_routed_experts", default=False)


@contextlib.contextmanager
def routed_experts_split():
    """Models built inside the block hold their routed experts per expert (`Drama3RoutedExperts`)."""
    token = _SPLIT_REQUESTED.set(True)
    try:
        yield
    finally:
        _SPLIT_REQUESTED.reset(token)


def routed_experts_split_requested() -> bool:
    return _SPLIT_REQUESTED.get()


class Drama3ExpertMLP(nn.Module):
    """One routed expert: `down_proj(act(gate_proj(x)) * up_proj(x))`."""

    def __init__(self, hidden_size: int, intermediate_size: int, act_fn):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = act_fn

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class Drama3RoutedExperts(nn.ModuleList):
    """`Qwen3_5MoeExperts` with one `Drama3ExpertMLP` per expert (children "0" .. "E-1")."""

    def __init__(self, config):
        act_fn = ACT2FN[config.hidden_act]
        super().__init__(
            Drama3ExpertMLP(config.hidden_size, config.moe_intermediate_size, act_fn) for _ in range(config.num_experts)
        )
        self.num_experts = config.num_experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states: [rows, H]; top_k_index, top_k_weights: [rows, k] (the router's choice and
        weights). Returns [rows, H]: sum over each row's k experts of weight * expert(row)."""
        output = torch.zeros_like(hidden_states)
        with torch.no_grad():
            hit = torch.unique(top_k_index).tolist()
        for expert in hit:
            rows, slot = torch.where(top_k_index == expert)
            expert_output = self[expert](hidden_states[rows]) * top_k_weights[rows, slot, None]
            output.index_add_(0, rows, expert_output.to(output.dtype))
        return output


def split_routed_experts(backbone: nn.Module) -> int:
    """Replace every fused `mlp.experts` of `backbone` by a `Drama3RoutedExperts` built from its
    config (on the current default device: meta while `from_pretrained` builds the model). The fused
    weights are not copied: use it on a model about to be loaded. Returns the number replaced."""
    config = backbone.config
    replaced = 0
    for layer in backbone.layers:
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is None or isinstance(experts, Drama3RoutedExperts):
            continue
        if not hasattr(experts, "gate_up_proj"):
            raise TypeError(f"{type(experts).__name__}: expected transformers' fused experts (gate_up_proj, down_proj)")
        mlp.experts = Drama3RoutedExperts(config)
        replaced += 1
    return replaced


def routed_experts_from_fused(experts: nn.Module, config) -> Drama3RoutedExperts:
    """A `Drama3RoutedExperts` holding copies of the fused `experts`' weights (tests, conversions)."""
    split = Drama3RoutedExperts(config).to(device=experts.gate_up_proj.device, dtype=experts.gate_up_proj.dtype)
    intermediate = config.moe_intermediate_size
    with torch.no_grad():
        for index, expert in enumerate(split):
            expert.gate_proj.weight.copy_(experts.gate_up_proj[index, :intermediate])
            expert.up_proj.weight.copy_(experts.gate_up_proj[index, intermediate:])
            expert.down_proj.weight.copy_(experts.down_proj[index])
    return split


__all__ = [
    "Drama3ExpertMLP",
    "Drama3RoutedExperts",
    "routed_experts_from_fused",
    "routed_experts_split",
    "routed_experts_split_requested",
    "split_routed_experts",
]

"""Expert offload: the routed experts in CPU RAM, the ones each step chooses copied to the GPU.

    model = AutoModel.from_pretrained("fishaudio/drama-3", dtype=torch.bfloat16)   # loads on the CPU
    offload_experts(model, cache_experts=51, device="cuda")     # `drama3 plan --gpu-gb 24` says how many
    codes = model.generate(**inputs)                            # generate, stream, the engine: as before
    print(expert_cache_stats(model))                            # hits, misses, evictions, copies

The routed experts are about 32B of the published model's 35.9B parameters, and a step reads only
`num_experts_per_tok` (8) of each layer's 256 per token. `offload_experts` keeps every routed
expert in (pinned) CPU RAM, moves everything else to `device`, and gives each layer a cache of
`cache_experts` experts on `device`, most recently used kept. Each step a layer's router chooses
its experts; the layer's `OffloadedExperts` reads the chosen ids, copies the experts that are not
resident from CPU RAM into the cache (evicting the least recently used ones this step does not
need), and computes with transformers' own experts function (the model's `experts_implementation`:
grouped_mm, batched_mm or the eager loop) over the cache: the same maths as the resident model.
When a step needs more experts than the cache holds (a long prefill, a large batch, a small
cache), the layer computes them a cache-full at a time.

Why not `device_map` with accelerate's offload hooks: they copy a whole module's weights in before
each forward and out after, which for a fused experts module is every expert of the layer, each
step. This module copies only the experts a step chooses, and only when they are not cached.

On CUDA the host store is pinned and each copy is `non_blocking` on the compute stream (so it is
ordered before the matmul that reads it, and the CPU goes on to queue the next copies). Reading
the chosen ids is one device-to-host synchronisation per layer and step: the offloaded model runs
eagerly (a compiled step, e.g. `generate(cache_implementation="static")` on CUDA, which compiles
by default, is refused with `COMPILE_REFUSAL` in torch's error: pass `disable_compile=True`), and
is for inference (the experts hold no gradients).

Order: choose the dtype when loading, then offload; `model.to(...)` after `offload_experts` moves
and casts everything else but leaves the routed experts where they are.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, fields

import torch
from torch import nn
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The fused routed-expert tensors: gate_up_proj [experts, 2 * intermediate, hidden], down_proj
[experts, hidden, intermediate]."""


COMPILE_REFUSAL = (
    "the routed experts are offloaded (offload_experts): a step reads its chosen experts on the host, which "
    "torch.compile and CUDA graphs cannot hold; decode eagerly (generate() without compile_config, "
    "disable_compile=True on a GPU; the engine and drama3 serve without --compile)"
)


@dataclass
class ExpertCacheStats:
    """Counters of the expert caches, summed over layers. Per layer and step each distinct chosen
    expert is one hit (resident) or one miss (copied in: one copy of its weights, `copied_bytes`);
    an eviction makes room for a miss."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    copies: int = 0
    copied_bytes: int = 0

    def __add__(self, other: ExpertCacheStats) -> ExpertCacheStats:
        return ExpertCacheStats(**{field.name: getattr(self, field.name) + getattr(other, field.name) for field in fields(self)})


class OffloadedExperts(nn.Module):
    """A layer's routed experts in CPU RAM with an LRU cache of `capacity` of them on `device`.

    Keeps the experts module's parameter names (`gate_up_proj`, `down_proj`, now CPU tensors), so
    the model's state dict and `save_pretrained` are unchanged. `forward(hidden_states [tokens,
    hidden], top_k_index [tokens, k], top_k_weights [tokens, k])` is the experts module's."""

    def __init__(self, experts: Qwen3_5MoeExperts, capacity: int, device: torch.device):
        super().__init__()
        self.num_experts = experts.num_experts
        self.capacity = capacity
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        for name in EXPERT_WEIGHTS:
            host = getattr(experts, name).detach().to("cpu")
            if pin:
                host = host.pin_memory()
            # a Parameter, so state_dict / save_pretrained keep the published names
            setattr(self, name, nn.Parameter(host, requires_grad=False))
        # The experts module itself computes, over the cache: its experts are the cache's slots,
        # and transformers' dispatch (its config's experts_implementation) runs as in the resident
        # model. Kept out of the module tree (not a submodule): the cache is not a weight.
        compute = experts
        for name in EXPERT_WEIGHTS:
            host = getattr(self, name)
            cache = torch.empty((capacity, *host.shape[1:]), dtype=host.dtype, device=self.device)
            setattr(compute, name, nn.Parameter(cache, requires_grad=False))
        compute.num_experts = capacity
        self.__dict__["compute"] = compute
        self.__dict__["eager_forward"] = getattr(type(experts).forward, "__wrapped__", type(experts).forward)
        self.resident: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self.free = list(range(capacity - 1, -1, -1))
        self.stats = ExpertCacheStats()
        self.expert_bytes = sum(getattr(self, name)[0].numel() * getattr(self, name).element_size() for name in EXPERT_WEIGHTS)

    def _apply(self, fn, recurse=True):
        # model.to(...) / .half() / .cuda(): the experts stay in CPU RAM and the cache where it is
        return self

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            raise RuntimeError(COMPILE_REFUSAL)
        chosen = top_k_index.unique().tolist()  # ascending; the one host synchronisation
        if len(chosen) <= self.capacity:
            self._make_resident(chosen)
            return self.compute(hidden_states, self._slots(top_k_index, chosen), top_k_weights)
        # more experts than slots: a cache-full at a time, the others masked to the sentinel slot
        # (`capacity`, which the eager experts loop skips)
        output = torch.zeros_like(hidden_states)
        for start in range(0, len(chosen), self.capacity):
            group = chosen[start : start + self.capacity]
            self._make_resident(group)
            output += self.eager_forward(self.compute, hidden_states, self._slots(top_k_index, group), top_k_weights)
        return output

    def _slots(self, top_k_index: torch.Tensor, experts: list[int]) -> torch.Tensor:
        """top_k_index [tokens, k] as cache slots: each expert of `experts` (resident) its slot,
        any other the sentinel `capacity`."""
        lookup = [self.capacity] * self.num_experts
        for expert in experts:
            lookup[expert] = self.resident[expert]
        return torch.tensor(lookup, dtype=top_k_index.dtype).to(top_k_index.device, non_blocking=True)[top_k_index]

    def _make_resident(self, experts: list[int]) -> None:
        """Copy in the experts of `experts` that are not resident, evicting the least recently used
        experts that `experts` does not hold."""
        needed = set(experts)
        for expert in experts:
            if expert in self.resident:
                self.stats.hits += 1
                self.resident.move_to_end(expert)
                continue
            self.stats.misses += 1
            slot = self.free.pop() if self.free else self._evict(needed)
            self._copy_in(expert, slot)
            self.resident[expert] = slot

    def _evict(self, needed: set[int]) -> int:
        victim = next(expert for expert in self.resident if expert not in needed)
        slot = self.resident.pop(victim)
        self.stats.evictions += 1
        return slot

    def _copy_in(self, expert: int, slot: int) -> None:
        non_blocking = self.device.type == "cuda"  # the host store is pinned there
        with torch.no_grad():
            for name in EXPERT_WEIGHTS:
                getattr(self.compute, name)[slot].copy_(getattr(self, name)[expert], non_blocking=non_blocking)
        self.stats.copies += 1
        self.stats.copied_bytes += self.expert_bytes

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, cached={self.capacity} on {self.device}, store=cpu"


def offload_experts(model: nn.Module, cache_experts: int, device: str | torch.device | None = None) -> nn.Module:
    """Keep `model`'s routed experts in CPU RAM and everything else on `device` (default: cuda
    when available, else cpu), with `cache_experts` experts of each layer cached on `device`
    (see the module docstring). Returns `model`, changed in place.

    `cache_experts` must be at least 1; above a layer's expert count it is lowered to it, with a
    warning. The model's routed experts must be transformers' fused float experts (not quantised,
    not already offloaded)."""
    spread = set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))
    if len(spread) > 1:
        raise ValueError(
            f"the model was loaded with a device_map over {sorted(spread)} (accelerate's hooks move its weights); load it "
            f"without device_map (on the CPU), then offload_experts moves everything but the routed experts"
        )
    layers = _expert_modules(model)
    experts = layers[0][1].num_experts
    if isinstance(cache_experts, bool) or not isinstance(cache_experts, int) or cache_experts < 1:
        raise ValueError(f"cache_experts={cache_experts!r}: expected a whole number of experts per layer, at least 1")
    if cache_experts > experts:
        warnings.warn(f"cache_experts={cache_experts} is more than the {experts} routed experts of a layer; caching all "
                      f"{experts}", stacklevel=2)
        cache_experts = experts
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    for name, module in layers:
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).register_module(child, OffloadedExperts(module, cache_experts, device))
    model.to(device)
    return model


def expert_cache_stats(model: nn.Module) -> ExpertCacheStats:
    """The expert caches' counters, summed over the model's offloaded layers."""
    total = ExpertCacheStats()
    for module in model.modules():
        if isinstance(module, OffloadedExperts):
            total = total + module.stats
    return total


def _expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every routed-experts module; a ValueError naming one that cannot be offloaded."""
    found = []
    for name, module in model.named_modules():
        if not name.endswith("mlp.experts"):
            continue
        if isinstance(module, OffloadedExperts):
            raise ValueError(f"{name}: the experts are already offloaded (offload_experts was called on this model)")
        weights = [getattr(module, weight, None) for weight in EXPERT_WEIGHTS]
        if not all(isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.is_floating_point()
                   and weight.dtype.itemsize >= 2 for weight in weights):
            raise ValueError(
                f"{name} is a {type(module).__name__} without fused float gate_up_proj / down_proj "
                f"[experts, out, in] (quantised experts?); offload_experts keeps float experts in CPU RAM: load the "
                f"model without a quantization_config (an FP8 checkpoint dequantises on the CPU)"
            )
        found.append((name, module))
    if not found:
        raise ValueError(f"{type(model).__name__} has no routed experts (no module named *.mlp.experts)")
    return found


__all__ = ["COMPILE_REFUSAL", "ExpertCacheStats", "OffloadedExperts", "expert_cache_stats", "offload_experts"]

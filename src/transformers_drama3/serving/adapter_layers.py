"""Many LoRA adapters on one base model, chosen per batch item, on fixed shapes.

    slots = AdapterSlots(model, slots=8, max_rank=16)    # wraps the "light" preset's layers
    slots.write(3, read_adapter("out/adapter", model, max_rank=16))
    with routed(torch.tensor([0, 3, 3, 0])):             # item i speaks with the adapter in slot index[i]
        model(...)                                       # slot 0 is the base model (no adapter)

Every Linear the "light" LoRA preset targets (`lora_targets.LIGHT_TARGET_MODULES`) becomes a
`SlotLoraLinear`: the base layer's own weight, plus a stack of LoRA factors for every slot,
A [slots, max_rank, in] and B [slots, out, max_rank] (B already scaled by alpha / r; a smaller
rank is zero-padded; slot 0 is zeros). A batch of items computes

    y = x W^T + B[index] (A[index] x)       (two batched matmuls over gathered factors)

The modules the preset trains in full (`modules_to_save`: the codebook heads and the codebook
embedding table) become `SlotLinear` / `SlotEmbedding`: one full copy per slot (slot 0 the base
weight), gathered per item the same way. No branch reads a tensor and every shape is fixed, so a
compiled decode step holds the adapters in its graph; writing a slot changes tensors in place.

The index a forward uses belongs to the calling thread (`routing.routed`): the serving engine's scheduler
thread and a text stream's worker thread run the same model at once, each with its own items.
Without an index a layer computes its base layer alone. The index has one entry per batch item
(or one entry for the whole batch); a layer that sees its input flattened to rows (the shared
expert: [batch * rows, in]) reads the same items from the row order.

`read_adapter` reads and checks a PEFT adapter folder (`adapter_config.json` +
`adapter_model.safetensors`, as `examples/finetune_voice_lora.py` writes it) against the served
model before anything is written: what differs is named (never the server's path), and a folder
that is refused changes nothing. Its files are read as `safe_files` reads them: regular files only
(a FIFO is refused, never waited on), inside the allowed folder once every link is resolved, of a
bounded size, within a time limit; its values are checked (`r` a positive integer, `lora_alpha` a
finite number in range, `use_rslora` a boolean, tensors of a floating-point dtype).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.lora_targets import LIGHT_TARGET_MODULES, full_trained_modules
from .routing import AdapterError, routed, routing_index  # noqa: F401  (AdapterError, routed: re-exported)
from .safe_files import OutsideRoot, parse_json, read_regular_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_FILE = "drama3_base.json"
"""Written beside an adapter by `examples/finetune_voice_lora.py`: the base model's architecture
(`base_fingerprint`), compared with the served model's at registration."""

_PREFIX = "base_model.model."


# ---------------------------------------------------------------------------------- layers


class SlotLoraLinear(nn.Linear):
    """A Linear (its weight and bias are the base layer's own parameters) plus LoRA factors per slot:
    lora_A [slots, max_rank, in], lora_B [slots, out, max_rank] (scaled), slot 0 zeros."""

    def __init__(self, base: nn.Linear, slots: int, max_rank: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        options = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.register_buffer("lora_A", torch.zeros(slots, max_rank, self.in_features, **options), persistent=False)
        self.register_buffer("lora_B", torch.zeros(slots, self.out_features, max_rank, **options), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        index = routing_index()
        if index is None:
            return out
        items = x.reshape(index.shape[0], -1, self.in_features)  # [items, rows, in]
        low = torch.bmm(items, self.lora_A[index].transpose(1, 2))  # [items, rows, max_rank]
        delta = torch.bmm(low, self.lora_B[index].transpose(1, 2))  # [items, rows, out]
        return out + delta.reshape(out.shape)

    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot` holds A [r, in] and the scaled B [out, r] (None: zeros, no adapter here)."""
        self.lora_A[slot].zero_()
        self.lora_B[slot].zero_()
        if a is not None:
            rank = a.shape[0]
            self.lora_A[slot, :rank].copy_(a)
            self.lora_B[slot, :, :rank].copy_(b)


class SlotLinear(nn.Linear):
    """A Linear trained in full by an adapter: weight_slots [slots, out, in], slot 0 the base weight."""

    def __init__(self, base: nn.Linear, slots: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        if base.bias is not None:
            raise AdapterError("a codebook head with a bias cannot be served per slot")
        stack = base.weight.detach()[None].repeat(slots, 1, 1)
        self.register_buffer("weight_slots", stack, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = routing_index()
        if index is None:
            return F.linear(x, self.weight)
        items = x.reshape(index.shape[0], -1, self.in_features)
        out = torch.bmm(items, self.weight_slots[index].transpose(1, 2))  # [items, rows, out]
        return out.reshape(*x.shape[:-1], self.out_features)

    def write(self, slot: int, weight: torch.Tensor | None) -> None:
        self.weight_slots[slot].copy_(self.weight.detach() if weight is None else weight)


class SlotEmbedding(nn.Embedding):
    """An embedding table trained in full by an adapter: weight_slots [slots, rows, dim], slot 0 the
    base table; item i looks up its slot's table."""

    def __init__(self, base: nn.Embedding, slots: int):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = base.padding_idx, base.max_norm, base.norm_type
        self.scale_grad_by_freq, self.sparse = base.scale_grad_by_freq, base.sparse
        self.weight = base.weight
        self.register_buffer("weight_slots", base.weight.detach()[None].repeat(slots, 1, 1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        index = routing_index()
        if index is None:
            return F.embedding(ids, self.weight)
        items = ids.reshape(index.shape[0], -1) + (index * self.num_embeddings)[:, None]  # rows of the stacked tables
        table = self.weight_slots.reshape(-1, self.embedding_dim)
        return F.embedding(items, table).reshape(*ids.shape, self.embedding_dim)

    def write(self, slot: int, weight: torch.Tensor | None) -> None:
        self.weight_slots[slot].copy_(self.weight.detach() if weight is None else weight)


# ---------------------------------------------------------------------------------- the model's slots


def lora_target_names(model) -> list[str]:
    """The Linear layers of `model` the "light" preset puts LoRA on."""
    pattern = re.compile(LIGHT_TARGET_MODULES)
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear) and pattern.fullmatch(name)]


def full_module_names(model) -> list[str]:
    """The modules of `model` the preset trains in full (their full names)."""
    suffixes = full_trained_modules(model)
    return [name for name, _ in model.named_modules() if any(name == s or name.endswith("." + s) for s in suffixes)]


def base_fingerprint(config) -> dict:
    """What an adapter's base model must share with the served one (sizes and layer kinds)."""
    text, tower = config.text_config, config.audio_decoder_config
    text_keys = ("hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                 "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim")
    tower_keys = ("dim", "n_head", "n_local_heads", "head_dim", "intermediate_size", "vocab_size", "num_codebooks",
                  "shared_enrichment_layers")
    fingerprint = {"model_type": config.model_type, "num_codebooks": config.num_codebooks,
                   "codebook_size": config.codebook_size}
    fingerprint.update({f"text_config.{key}": _plain(getattr(text, key, None)) for key in text_keys})
    fingerprint.update({f"audio_decoder_config.{key}": _plain(getattr(tower, key, None)) for key in tower_keys})
    return fingerprint


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _replace_module(model, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


class AdapterSlots:
    """The slot layers installed on a model: `slots` slots (slot 0 the base model), LoRA up to
    `max_rank`. Installing them changes no output: every slot starts as the base model."""

    def __init__(self, model, slots: int, max_rank: int):
        if slots < 2:
            raise ValueError(f"slots={slots}; expected at least 2 (slot 0 is the base model)")
        if max_rank < 1:
            raise ValueError(f"max_rank={max_rank}; expected at least 1")
        self.model, self.slots, self.max_rank = model, slots, max_rank
        self.lora: dict[str, SlotLoraLinear] = {}
        self.full: dict[str, nn.Module] = {}
        for name in lora_target_names(model):
            layer = SlotLoraLinear(model.get_submodule(name), slots, max_rank)
            _replace_module(model, name, layer)
            self.lora[name] = layer
        for name in full_module_names(model):
            base = model.get_submodule(name)
            layer = SlotEmbedding(base, slots) if isinstance(base, nn.Embedding) else SlotLinear(base, slots)
            _replace_module(model, name, layer)
            self.full[name] = layer

    def write(self, slot: int, adapter: AdapterWeights) -> None:
        """Put `adapter` (checked by `read_adapter`) into slot `slot` (1 .. slots - 1)."""
        if not 0 < slot < self.slots:
            raise ValueError(f"slot={slot}; expected 1 .. {self.slots - 1} (slot 0 is the base model)")
        with torch.no_grad():
            for name, layer in self.lora.items():
                a, b = adapter.lora.get(name, (None, None))
                layer.write(slot, a, b)
            for name, layer in self.full.items():
                layer.write(slot, adapter.full.get(name))

    def clear(self, slot: int) -> None:
        """Slot `slot` becomes the base model again."""
        self.write(slot, AdapterWeights("", "", 0))


# ---------------------------------------------------------------------------------- reading a folder


@dataclass
class AdapterWeights:
    """A checked adapter: lora[module] = (A [r, in], B [out, r] scaled by alpha / r), full[module] =
    the full weight of a module it trains in full."""

    name: str
    path: str
    rank: int
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    full: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in self.lora.values() for t in pair] + list(self.full.values())
        return sum(t.numel() * t.element_size() for t in tensors)


UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA adapters", "target_parameters": "LoRA on the routed experts (the \"heavy\" preset)",
    "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas", "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token rows", "lora_bias": "LoRA biases", "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA",
}


ACCEPTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The tensor dtypes an adapter file may hold (converted to the served model's dtype)."""
MAX_LORA_ALPHA = 4096
"""The largest `lora_alpha` taken: far above any recipe (alpha is commonly r or 2r, and r is at most
`--adapter-rank`), far below what makes a take degenerate (1e30 does)."""
MAX_JSON_FILE_BYTES = 2**20
"""The largest `adapter_config.json` / `drama3_base.json` read (PEFT writes about 1 KB)."""
READ_SECONDS = 30.0
"""How long reading one adapter file may take (then refused)."""


class AdapterOutsideRoot(AdapterError):
    """An adapter file that lies outside the folder the server may read adapters from."""


def read_adapter(path: str | os.PathLike, model, max_rank: int, name: str = "adapter",
                 root: str | os.PathLike | None = None, timeout: float = READ_SECONDS) -> AdapterWeights:
    """Read and check a PEFT LoRA folder against `model` (the served model, before its slots are
    installed or after): its config, every tensor's module, shape and dtype, the rank against
    `max_rank`, and the base model's fingerprint when the folder has one. Each file must be a
    regular file inside `root` (None: anywhere) once its links are resolved, read within `timeout`
    seconds (`safe_files.read_regular_file`). Raises `AdapterError` naming the adapter, its folder
    by name (never the server's path) and what differs (`AdapterOutsideRoot` for a file outside
    `root`); nothing is written anywhere."""
    path = os.fspath(path)
    what = f"adapter {name!r} ({os.path.basename(os.path.normpath(path))})"  # its folder's name, never the server's path
    if not os.path.isdir(path):
        raise AdapterError(f"{what}: no such folder")

    def read(file: str, max_bytes: int) -> bytes | None:
        return _read_file(os.path.join(path, file), file, root, max_bytes, timeout, what)

    config = _json_file(read(ADAPTER_CONFIG, MAX_JSON_FILE_BYTES), ADAPTER_CONFIG, what)
    if config is None:
        raise AdapterError(f"{what}: no {ADAPTER_CONFIG} (a PEFT adapter folder holds {ADAPTER_CONFIG} and "
                           f"{ADAPTER_WEIGHTS})")
    rank, scale = _checked_config(config, max_rank, what)
    _check_fingerprint(_json_file(read(BASE_FILE, MAX_JSON_FILE_BYTES), BASE_FILE, what), model, what)
    data = read(ADAPTER_WEIGHTS, max_adapter_bytes(model, max_rank))
    if data is None:
        raise AdapterError(f"{what}: no {ADAPTER_WEIGHTS}")
    return _checked_weights(_tensors(data, what), model, name, path, rank, scale, what)


def _read_file(file: str, label: str, root, max_bytes: int, timeout: float, what: str) -> bytes | None:
    """A file of the adapter folder (None when there is none), as `safe_files.read_regular_file` reads it."""
    try:
        return read_regular_file(file, root, max_bytes, timeout, label, "the folder this server reads adapters from")
    except FileNotFoundError:
        return None
    except OutsideRoot as error:
        raise AdapterOutsideRoot(f"{what}: {error}") from None
    except ValueError as error:
        raise AdapterError(f"{what}: {error}") from None


def _json_file(data: bytes | None, file: str, what: str) -> dict | None:
    """The JSON object of an adapter's file (None when there is none)."""
    if data is None:
        return None
    try:
        value = parse_json(data, file)
    except ValueError as error:
        raise AdapterError(f"{what}: {error}") from None
    if not isinstance(value, dict):
        raise AdapterError(f"{what}: {file} holds {type(value).__name__}; expected an object")
    return value


def _checked_config(config: dict, max_rank: int, what: str) -> tuple[int, float]:
    """(rank, the scale of B: alpha / r, or alpha / sqrt(r) for rsLoRA) of a config the slots can serve."""
    file = ADAPTER_CONFIG
    for key, meaning in UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise AdapterError(f"{what}: {file}: {key}={_shown(config[key])} ({meaning}) cannot be served per request; "
                               "merge it into a checkpoint instead (training.lora.merge_and_save)")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{what}: {file}: peft_type {_shown(config.get('peft_type'))}; expected 'LORA'")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{what}: {file}: bias={_shown(config['bias'])}; expected 'none'")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{what}: {file}: fan_in_fan_out=True; the model's layers are nn.Linear (False)")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{what}: {file}: r={_shown(rank)}; expected a positive integer")
    if rank > max_rank:
        raise AdapterError(f"{what}: {file}: rank {rank} is above the server's largest rank {max_rank} (--adapter-rank)")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= MAX_LORA_ALPHA:
        raise AdapterError(f"{what}: {file}: lora_alpha={_shown(alpha)}; expected a finite number in (0, {MAX_LORA_ALPHA}]")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"{what}: {file}: use_rslora={_shown(rslora)}; expected true or false")
    return rank, (alpha / math.sqrt(rank) if rslora else alpha / rank)


def _shown(value, limit: int = 40) -> str:
    """A config value as an error message quotes it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_fingerprint(theirs: dict | None, model, what: str) -> None:
    if theirs is None:
        return
    ours = base_fingerprint(model.config)
    differing = [f"{key}: adapter {_shown(theirs.get(key))}, served model {ours[key]!r}"
                 for key in ours if key in theirs and theirs[key] != ours[key]]
    if differing:
        raise AdapterError(f"{what}: trained on a different base model ({'; '.join(differing)})")


def max_adapter_bytes(model, max_rank: int) -> int:
    """The largest `adapter_model.safetensors` an adapter of `model` up to `max_rank` can be: every
    adapted layer's factors at the rank and every full-trained module, in float64, with room for
    the header. A larger file is refused before it is read."""
    modules = dict(model.named_modules())
    elements = sum(max_rank * (modules[name].in_features + modules[name].out_features) for name in lora_target_names(model))
    elements += sum(modules[name].weight.numel() for name in full_module_names(model))
    return elements * torch.float64.itemsize + 8 * 2**20


def _tensors(data: bytes, what: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as error:
        raise AdapterError(f"{what}: {ADAPTER_WEIGHTS} cannot be read ({error})") from None


def _checked_weights(tensors, model, name, path, rank, scale, what) -> AdapterWeights:
    modules = dict(model.named_modules())
    targets, full_names = set(lora_target_names(model)), set(full_module_names(model))
    weights = AdapterWeights(name, path, rank)
    factors: dict[str, dict[str, torch.Tensor]] = {}
    dtype = next(model.parameters()).dtype
    for key, tensor in tensors.items():
        if not key.startswith(_PREFIX):
            raise AdapterError(f"{what}: tensor {key!r} is not a PEFT adapter tensor (expected {_PREFIX}...)")
        if tensor.dtype not in ACCEPTED_DTYPES:
            raise AdapterError(f"{what}: tensor {key!r} is {str(tensor.dtype).removeprefix('torch.')}; expected "
                               "float16, bfloat16, float32 or float64")
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{what}: tensor {key!r} holds NaN or infinite values")
        module_path = key[len(_PREFIX):]
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight", module_path)
        if match:
            module, factor = match.groups()
            if module not in modules:
                raise AdapterError(f"{what}: LoRA on {module!r}, a module the served model does not have")
            if module not in targets:
                raise AdapterError(f"{what}: LoRA on {module!r}, which the server does not adapt (it serves the "
                                   "\"light\" preset's layers: lora_targets.LIGHT_TARGET_MODULES)")
            factors.setdefault(module, {})[factor] = tensor
            continue
        module, _, parameter = module_path.rpartition(".")
        if module not in full_names or parameter != "weight":
            raise AdapterError(f"{what}: tensor {key!r} trains {module_path!r} in full; the server holds full copies "
                               f"only of {sorted(full_names)}")
        expected = tuple(modules[module].weight.shape)
        if tuple(tensor.shape) != expected:
            raise AdapterError(f"{what}: {module_path} has shape {tuple(tensor.shape)}; the served model's is {expected}")
        weights.full[module] = tensor.to(dtype)
    for module, pair in factors.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{what}: {module} has {sorted(pair)} but not both lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        layer = modules[module]
        expected_a, expected_b = (rank, layer.in_features), (layer.out_features, rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise AdapterError(f"{what}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; with rank "
                               f"{rank} the served model needs {expected_a} and {expected_b}")
        weights.lora[module] = (a.to(dtype), (b.double() * scale).to(dtype))
    if not weights.lora and not weights.full:
        raise AdapterError(f"{what}: {ADAPTER_WEIGHTS} holds no LoRA or full-trained tensors")
    return weights


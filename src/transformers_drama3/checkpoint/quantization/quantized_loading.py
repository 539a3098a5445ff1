"""Drama 3 through transformers' weight quantisers: torchao (int8 / int4 weight-only) and
bitsandbytes (nf4 / 8-bit), routed experts included.

    from transformers import AutoModel, BitsAndBytesConfig, TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig
    model = AutoModel.from_pretrained("fishaudio/drama-3", quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    model = AutoModel.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"))
    model = AutoModel.from_pretrained(path, quantization_config=quantization_config_for("int4", config, device="cuda"))

What `Drama3ForSpeechGeneration.from_pretrained` does with such a config (`from_pretrained_quantized`):

1. It refuses, before reading any weight, what cannot work (`check_weight_quantization`): a
   quantiser that is not installed, int4 packing for CUDA kernels on a CPU destination, a
   float32 model with a bfloat16-only int4 layout, an int4 group that does not divide every
   quantised linear's inputs. Each error names the option and what would fit.
2. The model is built with its routed experts one linear per expert projection
   (`experts.Drama3RoutedExperts`, the published checkpoint's own tensor names), so the quantiser
   converts them as any other `nn.Linear`, and loading fills and quantises one expert projection
   at a time. transformers' fused 3-D experts are skipped by both quantisers.
3. Unless the config says otherwise, `DEFAULT_MODULES_TO_NOT_CONVERT` stays in the compute dtype:
   the Codebook-MTP tower and its codebook tables (`audio_decoder*`), `lm_head`, the router
   (`mlp.gate`) and the shared expert's gate. Embeddings and norms are not linears: no quantiser
   converts them. Quantised: every routed expert, and the backbone's dense projections (attention
   q/k/v/o, the Gated DeltaNet in_proj_* / out_proj, the shared expert's gate/up/down).
4. A checkpoint whose experts are block-FP8 ("bsgemm-moe") is read through a state dict whose
   expert entries dequantise when read (`dequantizing_state_dict`): transformers materialises one
   tensor, quantises it and drops it before reading the next, so at most one dense expert
   projection exists at a time, never a whole layer or model.

What of transformers this relies on beyond its API (tests/test_quantized_experts.py fails first
when an upgrade moves it): the per-expert checkpoint names load into `Drama3RoutedExperts` because
transformers' loader falls back to a key's own name when a conversion renames it to a parameter the
model lacks (the expert-fusing conversion registered for the backbone); a state dict entry is read
as `entry[...]` (how it reads a safetensors slice); `PreTrainedModel._load_pretrained_model` is the
private loader `integrations.PreTrainedModelWithLoadedFiles` already overrides and guards.

The quantised model computes, generates, streams, serves (`Drama3Engine`) and trains adapters
(QLoRA: `quantized_lora_config`) like the dense one. `save_pretrained` of a torchao-quantised model goes
through transformers' own writer (torchao's serialisation, not the published layout), and
`from_pretrained` of such a folder builds the per-expert layout again (`from_pretrained_prequantized`);
a bitsandbytes-quantised model is refused before anything is written (`check_saveable`).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .block_fp8 import dequantize_block_fp8, weight_block_size
from .experts import routed_experts_split
from .fp8_expert_layer import replace_transformers_fp8_experts
from .schemes import WEIGHT_OPTIONS


DEFAULT_MODULES_TO_NOT_CONVERT = [
    "lm_head",
    "audio_decoder",
    "audio_decoder_mtp",
    "audio_decoder_mtp_shared",
    r".*\.mlp\.gate",
    r".*\.mlp\.shared_expert_gate",
]
"""Kept in the compute dtype when a TorchAoConfig / BitsAndBytesConfig names none: the tower and its
codebook tables, the head, the router and the shared expert's gate (transformers matches each entry
from the start of a module name, up to a dot, or as a regex; `mlp.gate` does not match `gate_proj`)."""

_PACKAGES = {"torchao": "torchao", "bitsandbytes": "bitsandbytes"}


class QuantizationRefused(ValueError):
    """A quantisation request that cannot work here; the message names the option and what fits."""


def installed(package: str) -> bool:
    """Whether `package` can be imported (patched in tests to simulate a missing quantiser)."""
    return importlib.util.find_spec(package) is not None


# ----------------------------------------------------------------------------- which configs


def weight_quantizer(quantization_config) -> str | None:
    """"torchao" or "bitsandbytes" for a config this module loads, else None (transformers' own path)."""
    if quantization_config is None:
        return None
    method = quantization_config.get("quant_method") if isinstance(quantization_config, Mapping) else getattr(
        quantization_config, "quant_method", None
    )
    method = str(getattr(method, "value", method))
    if method == "torchao":
        return "torchao"
    if method == "bitsandbytes" or (
        isinstance(quantization_config, Mapping)
        and (quantization_config.get("load_in_4bit") or quantization_config.get("load_in_8bit"))
    ):
        return "bitsandbytes"
    return None


def quantized_in_features(config) -> dict[str, int]:
    """The input width of each kind of linear a weight quantiser converts by default (what an int4
    group size must divide), by module pattern."""
    return {pattern: inp for pattern, (_, inp) in quantized_linear_shapes(config).items()}


def int4_group_size(config, largest: int = 128) -> int:
    """The largest power-of-two group (at most `largest`, at least 16) dividing every quantised
    linear's inputs; 128 for the published model."""
    group = largest
    while group > 16 and any(width % group for width in quantized_in_features(config).values()):
        group //= 2
    return group


def quantization_config_for(option: str, config=None, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """The transformers quantisation config of `option` (`WEIGHT_OPTIONS`); it names no modules to
    keep, so loading keeps `DEFAULT_MODULES_TO_NOT_CONVERT` (`with_default_skips`):

    - "int8": `TorchAoConfig(Int8WeightOnlyConfig())`
    - "int4": on CUDA `TorchAoConfig(Int4WeightOnlyConfig(group_size=g, int4_packing_format=
      "tile_packed_to_4d"))` (packed, bfloat16); on the CPU `TorchAoConfig(IntxWeightOnlyConfig(
      weight_dtype=torch.int4, granularity=PerGroup(g)))`, torchao's only CPU int4 layout (one
      value a byte). g: `int4_group_size(config)` (128 without a config).
    - "nf4": `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)`
    - "bnb-int8": `BitsAndBytesConfig(load_in_8bit=True)`
    """
    if option not in WEIGHT_OPTIONS:
        raise QuantizationRefused(f"quantization option {option!r}: expected one of {', '.join(WEIGHT_OPTIONS)}")
    if option in ("int8", "int4"):
        _require("torchao", option)
        from transformers import TorchAoConfig

        if option == "int8":
            from torchao.quantization import Int8WeightOnlyConfig

            return TorchAoConfig(Int8WeightOnlyConfig())
        group = int4_group_size(config) if config is not None else 128
        if torch.device(device).type == "cuda":
            from torchao.quantization import Int4WeightOnlyConfig

            return TorchAoConfig(Int4WeightOnlyConfig(group_size=group, int4_packing_format="tile_packed_to_4d"))
        from torchao.quantization import IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerGroup

        return TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group)))
    _require("bitsandbytes", option)
    from transformers import BitsAndBytesConfig

    if option == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def option_of(quantization_config) -> str:
    """A short name of a weight-quantisation config, for messages: int8, int4, int4 (cpu layout), nf4, ..."""
    if weight_quantizer(quantization_config) == "bitsandbytes":
        if getattr(quantization_config, "load_in_4bit", False):
            return f"BitsAndBytesConfig(load_in_4bit, {getattr(quantization_config, 'bnb_4bit_quant_type', 'nf4')})"
        return "BitsAndBytesConfig(load_in_8bit)"
    quant_type = getattr(quantization_config, "quant_type", None)
    return f"TorchAoConfig({type(quant_type).__name__})"


def _require(package: str, option: str) -> None:
    if installed(package):
        return
    other = "bitsandbytes" if package == "torchao" else "torchao"
    instead = (
        "nf4 or bnb-int8 (BitsAndBytesConfig), bitsandbytes is installed" if other == "bitsandbytes" and installed(other)
        else "int8 or int4 (TorchAoConfig), torchao is installed" if installed(other)
        else "neither quantiser is installed"
    )
    raise QuantizationRefused(
        f"quantization {option}: needs {package}, which is not installed. Install it with "
        f"pip install 'transformers-drama3[quant]' (torchao and bitsandbytes); what fits now: {instead}."
    )


# ----------------------------------------------------------------------------- refusals


def _destination(device_map) -> set[str]:
    """The device types a `device_map` places weights on; {"cpu"} for None (transformers' default)
    except that bitsandbytes picks CUDA itself when there is a GPU."""
    if device_map is None:
        return {"cpu"}
    if isinstance(device_map, (str, int, torch.device)):
        values = [device_map]
    elif isinstance(device_map, Mapping):
        values = list(device_map.values())
    else:
        return {"cpu"}
    types = set()
    for value in values:
        if isinstance(value, int):
            types.add("cuda")
        elif str(value) in ("auto", "balanced", "balanced_low_0", "sequential"):
            types.add("cuda" if torch.cuda.is_available() else "cpu")
        elif str(value) == "disk":
            types.add("disk")
        else:
            types.add(torch.device(value).type)
    return types


def check_weight_quantization(quantization_config, config, device_map=None, dtype=None) -> None:
    """Refuse, before any weight is read, a weight-quantisation request that cannot work, naming
    the option and what would fit. `config`: the model's `Drama3Config`; `device_map`, `dtype`: as
    passed to `from_pretrained`."""
    package = weight_quantizer(quantization_config)
    option = option_of(quantization_config)
    if not installed(package):
        _require(package, option)
    destination = _destination(device_map if package == "torchao" or not torch.cuda.is_available() else device_map or "cuda")
    if "cuda" in destination and not torch.cuda.is_available():
        raise QuantizationRefused(f"quantization {option} with device_map={device_map!r}: this machine has no CUDA GPU; load on the CPU")
    if _bnb_4bit_on_cpu(quantization_config, device_map):
        skip = quantization_config.llm_int8_skip_modules or []
        uncovered = [pattern for pattern in bnb_cpu_misfits(config) if pattern not in skip]
        if uncovered:
            raise QuantizationRefused(
                f"quantization {option} on the CPU: bitsandbytes' 4-bit CPU kernel needs output widths that are "
                f"multiples of {BNB_CPU_ROW_BLOCK} and input widths multiples of {BNB_CPU_INPUT_BLOCK}, and {uncovered} "
                f"are not; add them to llm_int8_skip_modules "
                f"(leaving it None keeps them in the compute dtype), or use int8 (TorchAoConfig)."
            )
    if package != "torchao":
        return
    quant_type = quantization_config.quant_type
    name = type(quant_type).__name__
    if name == "Int4WeightOnlyConfig":
        if "cuda" not in destination or destination - {"cuda"}:
            raise QuantizationRefused(
                f"quantization {option} packs int4 for CUDA kernels only (torchao has no CPU layout for it) and "
                f"device_map={device_map!r} puts weights on {sorted(destination)}. Pass device_map='cuda', or on the CPU "
                f"use quantization_config_for('int4', config, device='cpu') (IntxWeightOnlyConfig, int4 values one a "
                f"byte) or 'nf4' (bitsandbytes, two a byte)."
            )
        packing = getattr(quant_type, "int4_packing_format", None)
        packing = str(getattr(packing, "value", packing))
        if packing == "tile_packed_to_4d" and dtype not in (None, "auto", torch.bfloat16, "bfloat16"):
            raise QuantizationRefused(
                f"quantization {option} (tile_packed_to_4d) computes in bfloat16 only; got dtype={dtype!r}. "
                f"Load with dtype=torch.bfloat16."
            )
    group = _group_size(quant_type)
    if group is not None:
        misfits = {kind: width for kind, width in quantized_in_features(config).items() if width % group}
        if misfits:
            raise QuantizationRefused(
                f"quantization {option} with group_size={group}: the inputs of {misfits} are not a multiple of it; "
                f"group_size={int4_group_size(config, group)} fits every quantised linear "
                f"(quantization_config_for('int4', config) picks it)."
            )


def _group_size(quant_type) -> int | None:
    group = getattr(quant_type, "group_size", None)
    if group is None:
        group = getattr(getattr(quant_type, "granularity", None), "group_size", None)
    return int(group) if group is not None else None


# bitsandbytes' 4-bit CPU kernel repacks a weight on its first inference call
# (bitsandbytes.functional._convert_weight_packed_for_cpu): in blocks of 32 output rows, and its
# absmax as [out, in / 64]; other widths fail there.
BNB_CPU_ROW_BLOCK = 32
BNB_CPU_INPUT_BLOCK = 64


def quantized_linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of each kind of linear a weight quantiser converts by default, by module pattern,
    from a `Drama3Config`."""
    text = config.text_config
    hidden, value_width = text.hidden_size, text.linear_num_value_heads * text.linear_value_head_dim
    shapes = {
        r".*\.mlp\.experts\.\d+\.(gate_proj|up_proj)": (text.moe_intermediate_size, hidden),
        r".*\.mlp\.experts\.\d+\.down_proj": (hidden, text.moe_intermediate_size),
        r".*\.mlp\.shared_expert\.(gate_proj|up_proj)": (text.shared_expert_intermediate_size, hidden),
        r".*\.mlp\.shared_expert\.down_proj": (hidden, text.shared_expert_intermediate_size),
    }
    if "linear_attention" in text.layer_types:
        key_width = text.linear_num_key_heads * text.linear_key_head_dim
        shapes[r".*\.linear_attn\.in_proj_qkv"] = (2 * key_width + value_width, hidden)
        shapes[r".*\.linear_attn\.in_proj_z"] = (value_width, hidden)
        shapes[r".*\.linear_attn\.in_proj_(a|b)"] = (text.linear_num_value_heads, hidden)
        shapes[r".*\.linear_attn\.out_proj"] = (hidden, value_width)
    if "full_attention" in text.layer_types:
        query_width = text.num_attention_heads * text.head_dim
        shapes[r".*\.self_attn\.q_proj"] = (2 * query_width, hidden)  # queries and their output gates
        shapes[r".*\.self_attn\.(k_proj|v_proj)"] = (text.num_key_value_heads * text.head_dim, hidden)
        shapes[r".*\.self_attn\.o_proj"] = (hidden, query_width)
    return shapes


def bnb_cpu_misfits(config) -> list[str]:
    """Module patterns whose shape bitsandbytes' 4-bit CPU kernel cannot take."""
    return [
        pattern for pattern, (out, inp) in quantized_linear_shapes(config).items()
        if out % BNB_CPU_ROW_BLOCK or inp % BNB_CPU_INPUT_BLOCK
    ]


def with_default_skips(quantization_config, config=None, device_map=None):
    """The config with `DEFAULT_MODULES_TO_NOT_CONVERT` where it names no modules to keep (a copy;
    the caller's object is left as it was). bitsandbytes 4-bit bound for the CPU also keeps the
    projections its CPU kernel cannot take (`bnb_cpu_misfits`; none in the published model)."""
    quantization_config = copy.deepcopy(quantization_config)
    attribute = "modules_to_not_convert" if weight_quantizer(quantization_config) == "torchao" else "llm_int8_skip_modules"
    if getattr(quantization_config, attribute, None) is None:
        skip = list(DEFAULT_MODULES_TO_NOT_CONVERT)
        if config is not None and _bnb_4bit_on_cpu(quantization_config, device_map):
            skip += bnb_cpu_misfits(config)
        setattr(quantization_config, attribute, skip)
    return quantization_config


def _bnb_4bit_on_cpu(quantization_config, device_map) -> bool:
    if weight_quantizer(quantization_config) != "bitsandbytes" or not getattr(quantization_config, "load_in_4bit", False):
        return False
    return "cpu" in _destination(device_map if not torch.cuda.is_available() else device_map or "cuda")


# ----------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class _Request:
    fp8_block: tuple[int, int] | None


_REQUEST: contextvars.ContextVar[_Request | None] = contextvars.ContextVar("drama3_quantized_load", default=None)

_HUB_KEYWORDS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")


def from_pretrained_quantized(cls, from_pretrained, pretrained_model_name_or_path, quantization_config, kwargs: dict):
    """`from_pretrained(pretrained_model_name_or_path, quantization_config=..., **kwargs)` with the
    routed experts per expert and, for a block-FP8 checkpoint, its experts dequantised one at a time
    as they are read (see the module docstring). `from_pretrained`: transformers' own."""
    if isinstance(quantization_config, Mapping):
        from transformers.quantizers.auto import AutoQuantizationConfig

        quantization_config = AutoQuantizationConfig.from_dict(dict(quantization_config))
    config = kwargs.pop("config", None)
    if config is None or isinstance(config, (str, os.PathLike)):
        hub = {key: kwargs[key] for key in _HUB_KEYWORDS if key in kwargs}
        config = cls.config_class.from_pretrained(config or pretrained_model_name_or_path, **hub)
    else:
        config = copy.deepcopy(config)
    quantization_config = with_default_skips(quantization_config, config, kwargs.get("device_map"))
    check_weight_quantization(quantization_config, config, kwargs.get("device_map"), kwargs.get("dtype", kwargs.get("torch_dtype")))
    fp8_block = weight_block_size(config.published_quantization_config) if config.is_block_fp8 else None
    # The checkpoint's experts are read and dequantised here; the weight quantiser is the only one.
    config.published_quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    token = _REQUEST.set(_Request(fp8_block))
    try:
        with routed_experts_split():
            model = from_pretrained(pretrained_model_name_or_path, config=config, quantization_config=quantization_config, **kwargs)
    finally:
        _REQUEST.reset(token)
    return model


def saved_weight_quantizer(pretrained_model_name_or_path) -> str | None:
    """"torchao" or "bitsandbytes" when a local checkpoint folder was saved from a model those
    quantised (its config.json's `quantization_config`), else None."""
    path = os.path.join(os.fspath(pretrained_model_name_or_path), "config.json") if isinstance(
        pretrained_model_name_or_path, (str, os.PathLike)) else None
    if path is None or not os.path.isfile(path):
        return None
    import json

    with open(path, encoding="utf-8") as reader:
        return weight_quantizer(json.load(reader).get("quantization_config"))


def check_saveable(model) -> None:
    """Refuse, before anything is written, to save a model bitsandbytes quantised: transformers'
    bitsandbytes deserialiser cannot read its per-expert weights back (the published per-expert
    names also match transformers' expert-fusing conversion, which takes the `.weight` away from
    its quantisation state). torchao-quantised models save and load back."""
    adapter_only = getattr(model, "_hf_peft_config_loaded", False)
    if not adapter_only and weight_quantizer(getattr(model.config, "quantization_config", None)) == "bitsandbytes":
        raise ValueError(
            "save_pretrained of a model quantised by bitsandbytes (nf4 / 8-bit) is not supported: its routed "
            "experts could not be loaded back. Save the dense model and quantise when loading "
            "(from_pretrained(..., quantization_config=BitsAndBytesConfig(...))), or quantise with torchao "
            "(int8 / int4), whose saved models load back."
        )


def from_pretrained_prequantized(from_pretrained, pretrained_model_name_or_path, args, kwargs: dict):
    """Load a checkpoint saved from a torchao-quantised model: the routed experts per expert, as
    they were saved, read by transformers' torchao deserialiser (bitsandbytes: `check_saveable`)."""
    if saved_weight_quantizer(pretrained_model_name_or_path) == "bitsandbytes":
        raise ValueError(
            f"{os.fspath(pretrained_model_name_or_path)}: saved from a model quantised by bitsandbytes, whose routed "
            f"experts cannot be loaded back; load the dense checkpoint with quantization_config=BitsAndBytesConfig(...)"
        )
    token = _REQUEST.set(_Request(None))
    try:
        with routed_experts_split():
            return from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
    finally:
        _REQUEST.reset(token)


def quantized_load_active() -> bool:
    return _REQUEST.get() is not None


def load_pretrained_weights(default_loader, plain_loader, model, state_dict, checkpoint_files, load_config, *args, **kwargs):
    """transformers' weight loading for a quantised load: a block-FP8 checkpoint's files through
    `dequantizing_state_dict`, other files as they are, and no record of the files for a
    byte-exact published save (`plain_loader`, transformers' own). Any other load: `default_loader`,
    then every routed experts module transformers kept in FP8 (`FP8Experts`) becomes a
    `fp8_experts.Drama3FP8Experts` holding the same tensors."""
    request = _REQUEST.get()
    if request is None:
        loaded = default_loader(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        # Experts transformers kept in FP8 (CUDA) are computed by the package's own FP8 kernels,
        # not by transformers' FP8Experts, whose matmuls need kernels fetched from the Hub.
        replace_transformers_fp8_experts(model)
        return loaded
    if request.fp8_block is not None and state_dict is None and checkpoint_files:
        if not all(str(file).endswith(".safetensors") for file in checkpoint_files):
            raise ValueError("a block-FP8 checkpoint is read from safetensors files only")
        with dequantizing_state_dict(checkpoint_files, request.fp8_block, load_config.dtype) as state_dict:
            return plain_loader(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
    if checkpoint_files:
        _refuse_unstated_fp8(checkpoint_files)
    return plain_loader(model, state_dict, checkpoint_files, load_config, *args, **kwargs)


def _refuse_unstated_fp8(files) -> None:
    """Without a "bsgemm-moe" config, FP8 experts would load as their raw bytes (no scales): refuse."""
    from safetensors import safe_open

    for file in files:
        if not str(file).endswith(".safetensors"):
            continue
        with safe_open(os.fspath(file), framework="pt") as handle:
            scaled = next((name for name in handle.keys() if name.endswith("_scale_inv")), None)
        if scaled is not None:
            raise ValueError(
                f"{file}: holds block-FP8 weights ({scaled}) but the model's config has no quantization_config "
                f"with quant_method 'bsgemm-moe'; add the published one to config.json, e.g. "
                f'{{"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}'
            )


class DequantizedSlice:
    """A block-FP8 weight read and dequantised only when indexed (as transformers reads a
    safetensors slice: `slice[...]`), so that each dense copy lives only while it is being quantised."""

    def __init__(self, handle, name: str, block: tuple[int, int], dtype: torch.dtype):
        self.handle, self.name, self.block, self.dtype = handle, name, block, dtype

    def get_dtype(self) -> str:
        return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[self.dtype]

    def get_shape(self) -> list[int]:
        return self.handle.get_slice(self.name).get_shape()

    def __getitem__(self, index):
        weight = self.handle.get_tensor(self.name)
        scale_inv = self.handle.get_tensor(self.name + "_scale_inv")
        return dequantize_block_fp8(weight, scale_inv, self.block, self.dtype)[index]


@contextlib.contextmanager
def dequantizing_state_dict(files, block: tuple[int, int], dtype: torch.dtype | None):
    """`{name: slice}` over the safetensors `files`, as transformers builds it, with every FP8
    `X.weight` that has an `X.weight_scale_inv` a `DequantizedSlice` (in `dtype`, bfloat16 by
    default) and the scales left out."""
    from safetensors import safe_open

    dtype = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
    with contextlib.ExitStack() as stack:
        state: dict[str, object] = {}
        for file in files:
            handle = stack.enter_context(safe_open(os.fspath(file), framework="pt"))
            names = set(handle.keys())
            for name in handle.keys():
                if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in names:
                    continue
                if name + "_scale_inv" in names:
                    state[name] = DequantizedSlice(handle, name, block, dtype)
                else:
                    state[name] = handle.get_slice(name)
        yield state


EXPERT_LINEARS = r".*\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
"""The routed experts' linears of a model loaded through a weight quantiser, as a PEFT target regex."""


def quantized_lora_config(config):
    """A PEFT `LoraConfig` (e.g. `training.lora.lora_config(model, preset)`) for a model loaded
    through a weight quantiser (QLoRA): `target_parameters` naming the fused experts (the "heavy"
    preset) become `target_modules` matching every expert's gate/up/down linears, which PEFT wraps
    over their quantised weights. A config without target parameters ("light") is returned as is
    (a copy)."""
    config = copy.deepcopy(config)
    if not config.target_parameters:
        return config
    if not isinstance(config.target_modules, str):
        raise ValueError(
            f"target_modules={config.target_modules!r}: give a regex string (as training.lora's presets do) "
            f"to add the routed experts' linears to"
        )
    config.target_parameters = None
    config.target_modules = f"(?:{config.target_modules})|{EXPERT_LINEARS}"
    return config


__all__ = [
    "DEFAULT_MODULES_TO_NOT_CONVERT",
    "DequantizedSlice",
    "QuantizationRefused",
    "WEIGHT_OPTIONS",
    "check_weight_quantization",
    "dequantizing_state_dict",
    "from_pretrained_quantized",
    "int4_group_size",
    "load_pretrained_weights",
    "quantization_config_for",
    "quantized_in_features",
    "quantized_load_active",
    "quantized_lora_config",
    "weight_quantizer",
    "with_default_skips",
]

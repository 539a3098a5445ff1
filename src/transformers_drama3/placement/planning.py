"""Memory you can read before you load: what each part of a Drama 3 model takes on the GPU.

    from transformers_drama3 import plan_memory
    plan = plan_memory("fishaudio/drama-3", quantization="int4", gpu_gb=24, streams=1, context=4096)
    print(plan.total / 2**30, plan.fits)

    drama3 plan --model fishaudio/drama-3 --gpu-gb 24            # every option, and what fits
    drama3 plan --model ./my-voice --quant int4 --gpu-gb 24      # one option; exit 1 if it does not fit

Everything comes from config files: the model is built on the `meta` device (no weight is read,
nothing is allocated) and every parameter and buffer is put in one part by its name:

    routed experts       model.language_model.layers.N.mlp.experts.*    (the fused 3-D tensors)
    dense backbone       the rest of the backbone: attention, Gated DeltaNet, router, shared
                         expert, norms, rotary buffers
    tower                audio_decoder_mtp*, audio_decoder.codebook_embeddings
    embeddings and head  embed_tokens, lm_head
    decode state         per stream: the `DecodeCache` of `context` rows (keys and values of the
                         full-attention and tower layers, conv and recurrent states of the Gated
                         DeltaNet layers), times `streams`
    codec                the codec beside the model (its `codec/config.json`, else the S2 codec
                         of `codec.pth`), float32 as the processor keeps it
    prefill              what a prefill of `prefill_rows` rows (over the whole batch) holds at
                         its largest beside the weights: a MoE layer's expert buffers
                         (`experts_buffer_bytes`: transformers' grouped GEMM, or the FP8
                         kernels' float32 per-assignment rows, which they compute a chunk at a
                         time); the teacher-forced tower runs its layers only, no codebook head
    workspace            `WORKSPACE_ALLOWANCE` (1 GiB): cuBLAS and Triton workspaces, the CUDA-
                         graph pools of the compiled step's intermediates, the allocator's
                         rounding; an allowance, not a measurement

The options (`QUANTIZATIONS`, from the most bytes a weight to the fewest):

    none   every weight in the compute dtype (bfloat16 by default)
    fp8    the routed experts in the published block-FP8 (1 byte a weight and one float32
           scale per 128 x 128 block, as transformers' FP8 experts hold them on a GPU with FP8
           kernels); everything else in the compute dtype
    int8   torchao weight-only int8: 1 byte a weight, a float32 scale and an int8 zero point
           per output row
    nf4    bitsandbytes 4-bit NF4: half a byte a weight, one float32 absmax per block of 64
    int4   torchao weight-only int4: half a byte a weight on CUDA (one a byte on the CPU), a
           bfloat16 scale and zero point per group of 128 inputs of each output row

The bytes of each quantised weight are the quantisers' own layouts, as
`checkpoint.quantization.weights.quantized_bytes` states them (the module that loads the
quantised models; their tests check it against what a loaded model holds).

Most faithful first means that order, except for a checkpoint whose routed experts are already
block-FP8 (the published one): there fp8 keeps exactly the checkpoint's weights and "none" holds
the same values dequantised in twice the memory, so fp8 comes first. (fp8 needs FP8 kernels:
compute capability 8.9 or newer; elsewhere transformers dequantises, which is the "none" plan.)

int8, int4 and nf4 quantise the routed experts and the backbone's dense projections (attention,
Gated DeltaNet and shared-expert projections); the tower, norms, router, shared-expert gate,
embeddings and head stay in the compute dtype (`quantized_weight`).

A plan fits when its total (the parts above) is at most the card's memory less `headroom` (10% by
default: the CUDA context, one step's activations and the allocator's slack). When an option does not fit,
`fitting` and `refusal` say what would: a smaller option, else the routed experts offloaded to CPU RAM
(`offload.offload_experts`) with the largest on-GPU cache of hot experts that fits.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from huggingface_hub import try_to_load_from_cache
from transformers import AutoConfig, AutoModel

from .accounting import parameter_kind
from ..checkpoint.quantization.quantized_loading import bnb_cpu_misfits, int4_group_size
from ..checkpoint.quantization.schemes import PLAN_OPTIONS
from ..checkpoint.quantization.weights import DEFAULT_INT4_GROUP, quantized_bytes
from ..codec import Drama3CodecConfig
from ..configuration_drama3 import Drama3Config
from ..kernels.fp8_expert_gemm import tiles_buffer_bytes
from ..modeling_drama3 import Drama3ForSpeechGeneration

QUANTIZATIONS = PLAN_OPTIONS
"""The options a plan is made for, from the most bytes a weight (the most faithful) to the fewest."""
PUBLISHED_MODEL = "fishaudio/drama-3"
DEFAULT_CONTEXT = 4096
"""Rows a stream's decode cache holds by default (prompt, references and frames)."""
DEFAULT_HEADROOM = 0.10
GIB = 1 << 30

PARTS = ("routed_experts", "dense_backbone", "tower", "embeddings_and_head", "codec")
PART_LABELS = {
    "routed_experts": "routed experts",
    "dense_backbone": "dense backbone",
    "tower": "tower",
    "embeddings_and_head": "embeddings + head",
    "codec": "codec",
}

# Which part each accounting kind (accounting.PARAMETER_KINDS) belongs to.
_KIND_PARTS = {
    "routed_experts": "routed_experts",
    "backbone": "dense_backbone",
    "text_embedding": "embeddings_and_head",
    "lm_head": "embeddings_and_head",
    "codebook_embeddings": "tower",
    "tower_embedding": "tower",
    "tower": "tower",
}

# The backbone's dense projections that int8 / int4 / nf4 quantise besides the routed experts.
_QUANTIZED_DENSE = re.compile(
    r"^model\.language_model\.layers\.\d+\.("
    r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)"
    r"|self_attn\.(q_proj|k_proj|v_proj|o_proj)"
    r"|mlp\.shared_expert\.(gate_proj|up_proj|down_proj)"
    r")\.weight$"
)

FP8_BLOCK = (128, 128)

DEFAULT_PREFILL_ROWS = 512
"""Rows prefilled at once by default: `drama3 serve`'s prefill chunk on a GPU (a request is
prefilled alone). A `generate()` call prefills batch x prompt rows at once: plan it with
`prefill_rows`."""
WORKSPACE_ALLOWANCE = GIB
"""GPU memory kept for what no config states (see the module docstring). Not measured yet:
`benchmarks/gpu.py` prints each run's peak beside its plan."""


# ----------------------------------------------------------------------------- bytes of one weight


def quantized_weight(name: str, quantization: str, config: Drama3Config | None = None, device: str = "cuda") -> bool:
    """Whether `quantization` stores the parameter `name` quantised (else in the compute dtype).
    With a config, nf4 on the CPU keeps the projections bitsandbytes' CPU kernel cannot take
    (`quantized_loading.bnb_cpu_misfits`; none in the published model)."""
    if quantization == "none":
        return False
    if _part_of(name) == "routed_experts":
        return True
    if quantization == "fp8" or not _QUANTIZED_DENSE.match(name):
        return False
    if quantization == "nf4" and config is not None and torch.device(device).type == "cpu":
        module = name.removesuffix(".weight")
        return not any(re.fullmatch(pattern, module) for pattern in bnb_cpu_misfits(config))
    return True


def quantized_weight_bytes(shape: tuple[int, ...], quantization: str, device: str = "cuda",
                           dtype: torch.dtype = torch.bfloat16, group_size: int = DEFAULT_INT4_GROUP) -> int:
    """Bytes a weight of `shape` ([out, in], or fused experts [experts, out, in]) takes under
    `quantization` (fp8, int8, int4, nf4) in the layout its quantiser stores on `device`, scales
    included: `checkpoint.quantization.weights.quantized_bytes`, the quantisers' own accounting."""
    if quantization not in QUANTIZATIONS[1:]:
        raise ValueError(f"quantization={quantization!r}; expected one of {', '.join(QUANTIZATIONS[1:])}")
    return quantized_bytes(shape, quantization, device=device, dtype=dtype, group_size=group_size)


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ExpertOffload:
    """The routed experts kept in CPU RAM, with `cache_experts` of each layer's on the GPU."""

    cache_experts: int
    num_experts: int
    """Routed experts of a layer."""
    cache_bytes: int
    """GPU bytes of the caches of every layer."""
    host_bytes: int
    """CPU RAM (pinned) that holds every routed expert."""


@dataclass(frozen=True)
class MemoryPlan:
    """The GPU bytes of each part of a model under one option (see the module docstring)."""

    source: str
    quantization: str
    dtype: torch.dtype
    routed_experts: int
    dense_backbone: int
    tower: int
    embeddings_and_head: int
    codec: int
    state_per_stream: int
    streams: int
    context: int
    gpu_bytes: int | None
    headroom: float
    offload: ExpertOffload | None = None
    prefill: int = 0
    """The largest transient of a prefill of `prefill_rows` rows (see the module docstring)."""
    prefill_rows: int = 0
    workspace: int = 0
    """`WORKSPACE_ALLOWANCE`."""

    @property
    def state(self) -> int:
        """Decode state of every stream."""
        return self.state_per_stream * self.streams

    @property
    def transients(self) -> int:
        """What comes and goes beside the weights and the state: the prefill's largest transient
        and the workspace allowance."""
        return self.prefill + self.workspace

    @property
    def total(self) -> int:
        return (self.routed_experts + self.dense_backbone + self.tower + self.embeddings_and_head + self.codec
                + self.state + self.transients)

    @property
    def usable(self) -> int | None:
        """The card's bytes less the headroom (None without a card)."""
        return None if self.gpu_bytes is None else int(self.gpu_bytes * (1 - self.headroom))

    @property
    def fits(self) -> bool | None:
        """Whether the total fits the card less the headroom (None without a card)."""
        return None if self.gpu_bytes is None else self.total <= self.usable

    @property
    def label(self) -> str:
        if self.offload is None:
            return self.quantization
        return f"offload ({self.offload.cache_experts} experts/layer cached)"


def plan_memory(
    model: str | os.PathLike | Drama3Config = PUBLISHED_MODEL,
    quantization: str = "none",
    gpu_gb: float | None = None,
    streams: int = 1,
    context: int = DEFAULT_CONTEXT,
    dtype: torch.dtype = torch.bfloat16,
    headroom: float = DEFAULT_HEADROOM,
    offload_cache_experts: int | None = None,
    codec_config=None,
    device: str = "cuda",
    prefill_rows: int = DEFAULT_PREFILL_ROWS,
) -> MemoryPlan:
    """The GPU bytes of each part of `model` under `quantization`, from config files alone.

    Args:
        model: a checkpoint folder, a Hub repo id whose config.json is in the local Hugging Face
            cache, `"fishaudio/drama-3"` (the published shape the package knows when it is not
            cached), or a `Drama3Config`.
        quantization: one of `QUANTIZATIONS`.
        gpu_gb: the card's memory in GiB (what `nvidia-smi` shows / 1024; a "24 GB" card has 24);
            None: no fit is judged.
        streams, context: streams decoded together, and the rows each stream's cache holds.
        dtype: the compute dtype (bfloat16 or float32) of what is not quantised.
        headroom: the fraction of the card kept free (see the module docstring).
        offload_cache_experts: keep the routed experts in CPU RAM with this many of each layer's
            experts cached on the GPU (`offload.offload_experts`; quantization must be "none").
        codec_config: the codec's config when `model` is a `Drama3Config` (default: the S2 codec).
        device: where the model will run, "cuda" (default) or "cpu": the quantisers store some
            options differently there (torchao's CPU int4 keeps one value a byte).
        prefill_rows: rows prefilled at once, over every stream (`DEFAULT_PREFILL_ROWS`: the
            server's chunk; a `generate()` of B prompts of P rows prefills B x P).
    """
    check_plan_arguments(quantization, gpu_gb, streams, context, dtype, headroom, device, prefill_rows)
    config, codec, source = resolve_configs(model, codec_config)
    return _plan(config, codec, source, quantization, gpu_gb, streams, context, dtype, headroom, offload_cache_experts,
                 device, prefill_rows)


def _plan(config, codec, source, quantization, gpu_gb, streams, context, dtype, headroom, offload_cache_experts, device,
          prefill_rows=DEFAULT_PREFILL_ROWS):
    if offload_cache_experts is not None:
        if quantization != "none":
            raise ValueError(
                f"offload_cache_experts with quantization={quantization!r}: the offloaded experts are kept in the "
                f"compute dtype; plan offload with quantization='none'"
            )
        experts = config.text_config.num_experts
        if not 1 <= offload_cache_experts <= experts:
            raise ValueError(f"offload_cache_experts={offload_cache_experts}: expected 1 to {experts} (the experts of a layer)")
    parts = _part_bytes(config, quantization, dtype, device)
    parts["codec"] = _codec_bytes(codec)
    offload = None
    if offload_cache_experts is not None:
        offload = _offload(config, dtype, offload_cache_experts, parts["routed_experts"])
        parts["routed_experts"] = offload.cache_bytes
    return MemoryPlan(
        source=source, quantization=quantization, dtype=dtype, **parts,
        state_per_stream=state_bytes_per_stream(config, context, dtype), streams=streams, context=context,
        gpu_bytes=None if gpu_gb is None else int(gpu_gb * GIB), headroom=headroom, offload=offload,
        prefill=prefill_bytes(config, prefill_rows, quantization, dtype), prefill_rows=prefill_rows,
        workspace=WORKSPACE_ALLOWANCE,
    )


def plan_options(
    model: str | os.PathLike | Drama3Config = PUBLISHED_MODEL,
    gpu_gb: float | None = None,
    streams: int = 1,
    context: int = DEFAULT_CONTEXT,
    dtype: torch.dtype = torch.bfloat16,
    headroom: float = DEFAULT_HEADROOM,
    codec_config=None,
    device: str = "cuda",
    prefill_rows: int = DEFAULT_PREFILL_ROWS,
) -> list[MemoryPlan]:
    """A plan for every option of `QUANTIZATIONS`, most faithful first (`preference`; arguments as
    `plan_memory`), then the routed experts offloaded (quantization "none") with the largest
    per-layer cache that fits the card, and at least one token's experts (`num_experts_per_tok`,
    also the cache without a card)."""
    check_plan_arguments("none", gpu_gb, streams, context, dtype, headroom, device, prefill_rows)
    config, codec, source = resolve_configs(model, codec_config)
    plans = [
        _plan(config, codec, source, quantization, gpu_gb, streams, context, dtype, headroom, None, device, prefill_rows)
        for quantization in preference(config)
    ]
    resident = next(plan for plan in plans if plan.quantization == "none")
    text = config.text_config
    cache = text.num_experts_per_tok  # the least that serves one token without evicting inside a layer
    if resident.gpu_bytes is not None:
        one_expert = _offload(config, dtype, 1, 0).cache_bytes
        room = resident.usable - (resident.total - resident.routed_experts)
        cache = max(cache, min(text.num_experts, room // one_expert))
    offload = _offload(config, dtype, int(cache), resident.routed_experts)
    return plans + [replace(resident, routed_experts=offload.cache_bytes, offload=offload)]


def preference(config: Drama3Config) -> tuple[str, ...]:
    """The options most faithful first: `QUANTIZATIONS`, but fp8 first for a checkpoint whose
    routed experts are block-FP8 (see the module docstring)."""
    if config.is_block_fp8:
        return ("fp8", *(option for option in QUANTIZATIONS if option != "fp8"))
    return QUANTIZATIONS


def max_streams(plan: MemoryPlan) -> int:
    """How many streams of `plan.context` rows fit the card beside the weights (0 without a card
    or when the weights alone do not fit)."""
    if plan.gpu_bytes is None:
        return 0
    room = plan.usable - (plan.total - plan.state)
    return max(0, room // plan.state_per_stream)


def fitting(options: list[MemoryPlan]) -> list[MemoryPlan]:
    """The plans of `options` that fit their card, most faithful first (empty without a card)."""
    return [option for option in options if option.fits]


def refusal(options: list[MemoryPlan], asked: MemoryPlan | None = None) -> str:
    """Why `asked` (or, without it, every option of `options`) does not fit the card, and what
    would: the options that fit, else the smallest plan and the card it needs."""
    first = asked or options[0]
    usable = f"{first.usable / GIB:.1f} GiB are usable ({100 * first.headroom:g}% of {first.gpu_bytes / GIB:g} GiB kept free)"
    if asked is not None:
        message = f"--quant {asked.quantization} needs {asked.total / GIB:.1f} GiB and {usable}"
    else:
        message = f"no option fits: {usable}"
    fit = fitting(options)
    if fit:
        names = ", ".join(f"{option.label} ({option.total / GIB:.1f} GiB)" for option in fit)
        return f"{message}; what fits: {names}"
    smallest = min(options, key=lambda option: option.total)
    return (
        f"{message}; the smallest plan, {smallest.label}, needs {smallest.total / GIB:.1f} GiB: use a GPU of at least "
        f"{math.ceil(smallest.total / (1 - first.headroom) / GIB)} GiB, or fewer streams / a shorter context"
    )


def check_plan_arguments(quantization, gpu_gb, streams, context, dtype, headroom, device="cuda",
                         prefill_rows=DEFAULT_PREFILL_ROWS) -> None:
    """A ValueError naming the argument that is out of range (before any work)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
    if gpu_gb is not None and not (isinstance(gpu_gb, (int, float)) and math.isfinite(gpu_gb) and gpu_gb > 0):
        raise ValueError(f"gpu_gb={gpu_gb!r}; expected a positive number of GiB")
    if not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams={streams!r}; expected a positive whole number")
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context={context!r}; expected a positive number of rows")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype={dtype}; expected torch.bfloat16, torch.float16 or torch.float32")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom!r}; expected a fraction in [0, 1)")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}; expected 'cuda' or 'cpu'")
    if isinstance(prefill_rows, bool) or not isinstance(prefill_rows, int) or prefill_rows < 1:
        raise ValueError(f"prefill_rows={prefill_rows!r}; expected a positive number of rows")


# ----------------------------------------------------------------------------- configs


def published_config() -> Drama3Config:
    """The published `fishaudio/drama-3` shape as this package knows it (the config defaults: the
    Qwen3.5-35B-A3B backbone, the 13-layer tower) with its block-FP8 routed experts."""
    return Drama3Config(quantization_config={
        "quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK),
    })


def resolve_configs(model, codec_config=None):
    """(Drama3Config, codec config, where they came from) for `model` (see `plan_memory`)."""
    if isinstance(model, Drama3Config):
        return model, codec_config or Drama3CodecConfig(), "the given config"
    source = os.fspath(model)
    if os.path.isdir(source):
        config_file = os.path.join(source, "config.json")
        if not os.path.isfile(config_file):
            raise ValueError(f"model={source!r}: the folder has no config.json; expected a Drama 3 checkpoint folder")
        return _read_config(config_file), _codec_config_beside(source), source
    looks_like_repo_id = source.count("/") == 1 and not source.startswith((".", "/", "~"))
    if not looks_like_repo_id:
        raise ValueError(f"model={source!r}: no such folder, and not a Hub repo id (owner/name)")
    cached = _cached_file(source, "config.json")
    if cached is not None:
        return _read_config(cached), _cached_codec_config(source), f"{source} (Hugging Face cache)"
    if source == PUBLISHED_MODEL:
        return published_config(), Drama3CodecConfig(), f"{source} (the published shape this package knows)"
    raise ValueError(
        f"model={source!r}: its config.json is not in the local Hugging Face cache; download it first "
        f"(huggingface-cli download {source} config.json) or give a checkpoint folder"
    )


def _read_config(config_file: str) -> Drama3Config:
    try:
        return Drama3Config.from_json_file(config_file)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{config_file}: {error}") from None


def _codec_config_beside(folder: str):
    codec_file = os.path.join(folder, "codec", "config.json")
    return _codec_config_from(codec_file) if os.path.isfile(codec_file) else Drama3CodecConfig()


def _cached_codec_config(repo: str):
    codec_file = _cached_file(repo, "codec/config.json")
    return _codec_config_from(codec_file) if codec_file is not None else Drama3CodecConfig()


def _codec_config_from(config_file: str):
    with open(config_file, encoding="utf-8") as reader:
        values = json.load(reader)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _cached_file(repo: str, filename: str) -> str | None:
    found = try_to_load_from_cache(repo, filename)
    return found if isinstance(found, str) else None


# ----------------------------------------------------------------------------- bytes of each part


@lru_cache(maxsize=8)
def _meta_tensors(config_json: str) -> tuple[tuple[str, tuple[int, ...], torch.dtype | None], ...]:
    """(name, shape, dtype for a buffer / None for a parameter) of every tensor of the model for
    the config `config_json`, built on the meta device."""
    config = Drama3Config(**json.loads(config_json))
    with torch.device("meta"):
        model = Drama3ForSpeechGeneration(config)
    tensors = [(name, tuple(tensor.shape), None) for name, tensor in model.named_parameters()]
    tensors += [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in model.named_buffers()]
    return tuple(tensors)


def _part_of(name: str) -> str:
    try:
        return _KIND_PARTS[parameter_kind(name)]
    except ValueError:  # buffers (rotary tables) are not in the parameter table
        return "tower" if name.startswith("audio_decoder") else "dense_backbone"


def _part_bytes(config: Drama3Config, quantization: str, dtype: torch.dtype, device: str) -> dict[str, int]:
    element = torch.empty((), dtype=dtype).element_size()
    group = int4_group_size(config)
    parts = dict.fromkeys(PARTS[:-1], 0)
    for name, shape, buffer_dtype in _meta_tensors(config.to_json_string()):
        if buffer_dtype is not None:
            size = math.prod(shape) * torch.empty((), dtype=buffer_dtype).element_size()
        elif quantized_weight(name, quantization, config, device):
            size = quantized_weight_bytes(shape, quantization, device, dtype, group)
        else:
            size = math.prod(shape) * element
        parts[_part_of(name)] += size
    return parts


def _codec_bytes(codec_config) -> int:
    """Bytes of the codec's parameters and buffers, float32, built on the meta device."""
    with torch.device("meta"):
        codec = AutoModel.from_config(codec_config)
    return sum(tensor.numel() * 4 for tensor in (*codec.parameters(), *codec.buffers()) if tensor.is_floating_point()) + sum(
        tensor.numel() * tensor.element_size() for tensor in codec.buffers() if not tensor.is_floating_point()
    )


def _offload(config: Drama3Config, dtype: torch.dtype, cache_experts: int, host_bytes: int) -> ExpertOffload:
    text = config.text_config
    element = torch.empty((), dtype=dtype).element_size()
    one_expert = 3 * text.moe_intermediate_size * text.hidden_size * element  # gate, up, down
    cache = text.num_hidden_layers * cache_experts * one_expert
    return ExpertOffload(cache_experts=cache_experts, num_experts=text.num_experts, cache_bytes=cache,
                         host_bytes=host_bytes)


def state_bytes_per_stream(config: Drama3Config, context: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one stream's `DecodeCache` of `context` rows (`decoding/state.py`): keys and values
    of each full-attention and tower layer, conv state (compute dtype) and recurrent state
    (float32, as both Gated DeltaNet paths keep it) of each Gated DeltaNet layer, and the two
    parts' `next_column`."""
    text, tower = config.text_config, config.audio_decoder_config
    element = torch.empty((), dtype=dtype).element_size()
    keys_values = 0
    linear = 0
    for kind in text.layer_types[: text.num_hidden_layers]:
        if kind == "linear_attention":
            key_dim = text.linear_num_key_heads * text.linear_key_head_dim
            value_dim = text.linear_num_value_heads * text.linear_value_head_dim
            conv = (2 * key_dim + value_dim) * text.linear_conv_kernel_dim * element
            recurrent = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
            linear += conv + recurrent
        else:
            keys_values += 2 * text.num_key_value_heads * context * text.head_dim * element
    tower_layers = tower.num_tower_layers
    keys_values += tower_layers * 2 * tower.n_local_heads * context * tower.head_dim * element
    next_columns = 2 * 8
    return keys_values + linear + next_columns


def experts_buffer_bytes(config: Drama3Config, rows: int, quantization: str = "none",
                         dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one MoE layer makes beside its input and output for `rows` rows (as if none were
    freed before the last is made). fp8: the FP8 kernels' tiles layout, a chunk of tokens at a
    time (`fp8_experts.tiles_buffer_bytes`). The other options: transformers' grouped GEMM, per
    (token, expert) assignment the rows gathered by expert, the gate-up product, the activation
    and its product, the down product, its weighting and the rows put back (4 x hidden + 4 x
    intermediate values) and 64 bytes of routing (the sort, the expert offsets)."""
    text = config.text_config
    element = torch.empty((), dtype=dtype).element_size()
    top_k, hidden, intermediate = text.num_experts_per_tok, text.hidden_size, text.moe_intermediate_size
    if quantization == "fp8":
        return tiles_buffer_bytes(rows, top_k, hidden, intermediate, element)
    assignments = rows * top_k
    return assignments * (4 * hidden + 4 * intermediate) * element + assignments * 64


def prefill_bytes(config: Drama3Config, rows: int, quantization: str = "none", dtype: torch.dtype = torch.bfloat16) -> int:
    """The largest transient of a prefill of `rows` rows: the backbone's expert buffers, layer by
    layer. The tower runs its layers over the rows but none of its codebook heads
    (`Drama3ForSpeechGeneration.prefill`), so no [rows, 9, 4096] logits are made."""
    return experts_buffer_bytes(config, rows, quantization, dtype)


# ----------------------------------------------------------------------------- printing


def format_plans(plans: list[MemoryPlan]) -> str:
    """A table of the plans' parts in GiB, one option a row, and whether each fits."""
    first = plans[0]
    header = ["option", *(PART_LABELS[part] for part in PARTS[:-1]), f"state x{first.streams}", "codec",
              "prefill + workspace", "total"]
    judged = first.gpu_bytes is not None
    if judged:
        header.append(f"fits {first.gpu_bytes / GIB:g} GiB")
    rows = []
    for plan in plans:
        row = [plan.label, *(f"{getattr(plan, part) / GIB:.2f}" for part in PARTS[:-1]), f"{plan.state / GIB:.2f}",
               f"{plan.codec / GIB:.2f}", f"{plan.transients / GIB:.2f}", f"{plan.total / GIB:.2f}"]
        if judged:
            row.append("yes" if plan.fits else "no")
        rows.append(row)
    widths = [max(len(line[column]) for line in (header, *rows)) for column in range(len(header))]
    lines = ["  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                       for column, (cell, width) in enumerate(zip(line, widths))) for line in (header, *rows)]
    notes = [
        f"model: {first.source}; GiB; {str(first.dtype).removeprefix('torch.')} compute; decode state of "
        f"{first.streams} stream(s) of {first.context} rows ({first.state_per_stream / GIB:.3f} GiB each); a prefill "
        f"of {first.prefill_rows} rows at once and {first.workspace / GIB:g} GiB of workspace",
    ]
    if judged:
        notes.append(f"fits: total <= {first.usable / GIB:.1f} GiB ({100 * first.headroom:g}% of the card kept free)")
    for plan in plans:
        if plan.offload is not None:
            notes.append(
                f"offload: routed experts in pinned CPU RAM ({plan.offload.host_bytes / GIB:.1f} GiB), "
                f"{plan.offload.cache_experts} of each layer's {plan.offload.num_experts} cached on the GPU "
                f"(offload_experts(model, cache_experts={plan.offload.cache_experts}))"
            )
    return "\n".join(lines + notes)


# How a user loads each option (transformers' own quantisers; the package's expert offload).
LOAD_CODE = {
    "none": 'AutoModel.from_pretrained("{model}", dtype=torch.bfloat16, device_map="cuda")',
    # the published experts are block-FP8 already: its config makes transformers keep them so
    "fp8": 'AutoModel.from_pretrained("{model}", dtype=torch.bfloat16, device_map="cuda")',
    "int8": 'AutoModel.from_pretrained("{model}", device_map="cuda", quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))',
    "int4": 'AutoModel.from_pretrained("{model}", device_map="cuda", quantization_config=TorchAoConfig(Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")))',
    "nf4": 'AutoModel.from_pretrained("{model}", device_map="cuda", quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))',
    "offload": 'offload_experts(AutoModel.from_pretrained("{model}", dtype=torch.bfloat16), device="cuda", cache_experts={cache})',
}
TABLE_GPUS = (24, 48, 80)


def load_code(plan: MemoryPlan, model: str = PUBLISHED_MODEL) -> str:
    """The Python that loads `plan`'s option."""
    if plan.offload is not None:
        return LOAD_CODE["offload"].format(model=model, cache=plan.offload.cache_experts)
    return LOAD_CODE[plan.quantization].format(model=model)


def gpu_table(model=PUBLISHED_MODEL, gpus=TABLE_GPUS, context: int = DEFAULT_CONTEXT) -> str:
    """The memory guide's table (docs/memory.md): for each card of `gpus` GiB, the most faithful
    option that fits the published model with one stream of `context` rows, its GPU memory, how
    many such streams fit beside it, and how to load it."""
    lines = [
        f"| GPU | most faithful option that fits | GPU memory (1 stream) | streams of {context} rows | check | load with |",
        "|---|---|---|---|---|---|",
    ]
    for gpu in gpus:
        fit = fitting(plan_options(model, gpu, context=context))
        command = f"`drama3 plan --gpu-gb {gpu}`"
        if not fit:
            lines.append(f"| {gpu} GiB | nothing | - | - | {command} | - |")
            continue
        best = fit[0]
        lines.append(
            f"| {gpu} GiB | {best.label} | {best.total / GIB:.1f} GiB | {max_streams(best)} | {command} | "
            f"`{load_code(best)}` |"
        )
    return "\n".join(lines)


def parts_table(model=PUBLISHED_MODEL, context: int = DEFAULT_CONTEXT) -> str:
    """The memory guide's table (docs/memory.md) of each part's GiB under each option (one stream
    of `context` rows)."""
    plans = plan_options(model, context=context)
    header = ["option", *(PART_LABELS[part] for part in PARTS[:-1]), "state (1 stream)", "codec",
              "prefill + workspace", "total"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for plan in plans:
        cells = [plan.label, *(f"{getattr(plan, part) / GIB:.2f}" for part in PARTS[:-1]),
                 f"{plan.state / GIB:.2f}", f"{plan.codec / GIB:.2f}", f"{plan.transients / GIB:.2f}",
                 f"{plan.total / GIB:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    """Print the memory guide's tables for the published model."""
    print(parts_table())
    print()
    print(gpu_table())


if __name__ == "__main__":
    main()

"""Drama 3 decode speed on one GPU: the published model at its full depth (random weights).

    PYTHONPATH=src python benchmarks/gpu.py                          # one H200: bf16 experts
    PYTHONPATH=src python benchmarks/gpu.py --experts fp8 --json fp8.json
    PYTHONPATH=src python benchmarks/gpu.py --dry-run                # the same code, tiny, CPU, seconds

The model is the published config (hidden 2048, 40 backbone layers of 3 Gated DeltaNet : 1
attention, 256 routed experts of which 8 per token plus a shared expert, the 13-layer tower, the
full vocabulary), built on the meta device and materialised directly on the GPU in bf16 with the
model's own random initialisation (`--layers` for a quick run at fewer layers; nothing is
extrapolated). `--experts fp8` keeps the routed experts in the published block-FP8 (128 x 128
blocks) through the library's `checkpoint.quantization.fp8_experts.quantize_experts_fp8`.

Each mode (`--modes`) decodes through the library's public loop (`decoding.loop.DecodeRun.
steps_ahead()`, the loop `generate()` runs: each step one call of `step.step`, draw and feed, the
next step queued before the host reads the last; the sampler made by
`decoding.request.make_sampler`, the serving defaults):

  compiled  the step compiled as `generate(cache_implementation="static")` does on a GPU
            (`default_compile_config()`: inductor, fullgraph, CUDA graphs, torch's automatic
            dynamic shapes: the first batch size compiles a graph of its shapes, the second one
            with the batch size symbolic that the later ones run, batch 1 its own; CUDA graphs
            record one graph per batch size); on the dry run's CPU the same fullgraph trace through
            `aot_eager` (no CUDA graphs there);
  eager     the same step, not compiled.
  in-order  (only when asked) compiled, stepped by `DecodeRun.steps()` as the text stream steps:
            `draw` and `feed` as two graphs, each draw read on the host before its row is fed;
            against the compiled row it says what one graph per step, queued ahead, is worth;
  prefill-graphs  (only when asked) compiled, and the prompt prefilled by the compiled prefill of
            its length bucket too (`generate(..., prefill_graphs=True)`): its TTFA against the
            compiled row's says what the prefill graphs are worth.

On a GPU the batch sizes whose plan does not fit its free memory (less 10%, `planning.plan_memory`:
weights, codec, decode state, the transients of the batch's prefill of batch x `--prompt-rows` rows
at once and the workspace allowance) are left out before anything is built, each named in a line
"NOT MEASURED: ..." (the bf16 experts alone are 60 GiB); none fitting exits naming `--experts fp8`.

Every timed shape is warmed first: for each batch size (`--batches`) one whole run of the timed
length (the prefill of `--prompt-rows` rows, the compile and the CUDA-graph capture, Triton's
autotuning, the codec at that batch) before the timed run. eos is masked out of the restricted
logits, so every run makes exactly `--frames` frames. Per mode and batch size it prints one row:

  ms/frame      wall time of one decode step (one frame for every item), mean over the frames
                after the first audio (frames 11 onward), the loop's host work included;
  frames/s      batch * 1000 / ms per frame (all items);
  kernels/step  CUDA kernels the profiler (CUPTI) records during one step of the timed mode, the
                one that makes the 5th frame of a fresh run (copies, memsets and synchronisations
                not counted): in the compiled mode the kernels the replayed CUDA graphs launch
                (CUPTI reports each kernel node of a graph launch) plus any outside them. On the dry
                run's CPU the column is "aten ops/step": the ATen operators one step calls (the
                profiler's top-level aten:: events), before any fusion;
  graphs/step   CUDA-graph launches (`cudaGraphLaunch`) in that step; "n/a (CPU)" on the dry run;
  GB/step       weights one step reads, from the config: the dense backbone (attention, Gated
                DeltaNet, router, shared expert, norms; `accounting.account`), the restricted
                head rows (semantic band + eos) and one embedding row, the tower, and the routed
                experts the batch reaches at the expert format's bytes (the planner's
                `plan_memory` bytes of the routed experts, per expert; a batch of B tokens reaches
                E (1 - (1 - k/E)^B) distinct experts of a layer when routing is uniform, k at B = 1,
                which makes batch 1 the paper's "weights read per frame", ~6.0 GB with FP8 experts);
  floor ms      GB/step / the copy bandwidth measured at the start of the run (a large
                device-to-device copy, counting the bytes it reads and writes: how fast the
                memory moves bytes; the bandwidth floor of a step that only streams its weights);
  x floor       ms/frame / floor ms;
  TTFA ms       time to first audio: from the start of `DecodeRun.prefilled` (cache set up, prompt
                of `--prompt-rows` rows prefilled) to the 10th frame of every item on the host;
  +codec ms     the same, plus the S2 codec (`Drama3Processor`'s codec, the published shape,
                random weights, float32 as the processor keeps it) decoding those 10 frames
                through its streaming decoder (the serving schedule's first window);
  captured      compiled on CUDA: "yes" when torch skipped no CUDA graph
                (`torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]` unchanged, no
                "skipping cudagraphs" log line) and the profiled step replayed one graph (`step`:
                draw and feed in one) and no more (more would be a step cut into partitions around
                host work); "no" otherwise, naming the graph; "n/a" for eager and on the CPU.

Any graph not captured makes the run exit with status 1 after the table; each failure is printed
as "NOT CAPTURED: <mode, batch>, <graph>: ..." under its row and again at the end (grep-able,
beside torch's own "skipping cudagraphs" lines). Batch sizes are measured in the order given,
every mode of one batch size before the next (a run cut short keeps whole batch sizes).

Each run sets up its own cache, as every `generate()` call does, so a compiled run records its
CUDA graphs afresh at its first steps (new static addresses): that is in its time to first audio,
not in ms/frame.
Under each row: a compiled mode's compile time (the warm-up run's seconds less the timed run's: the
compile, the CUDA-graph capture and Triton's autotuning; `--dry-run --layers 40` prints the CPU's,
a lower bound for a GPU machine's, whose inductor also generates and compiles kernels), on a GPU the
peak memory torch reserved against the plan's total, and with `--list-kernels` the profiled step's
kernels by name (ATen ops on the CPU).

`--json PATH` writes the numbers (rewritten after every row, so a run cut short keeps its rows),
with the graphs dynamo compiled in each warm-up and after it (0 when the warm-up covered the shape)
and the host time of dynamo's guard checks in the profiled step (`guard_ms`: a compiled run checks
every guard only on its first and every 32nd call, `decoding.steady_guards`) and of the whole step
before it waits for the device (`host_ms`: near ms/frame on a GPU, the host bounds the step).
Prints and asserts nothing else. The paper's engine: 271 frames/s at batch 1 on one H200, 1,278
kernels per step, 6.0 GB per frame (the issue's floor: 1.4 ms per frame at 4.3 TB/s).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import torch
from transformers import CompileConfig

from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration
from transformers_drama3.placement.accounting import account
from transformers_drama3.codec import Drama3CodecConfig, Drama3CodecModel
from transformers_drama3.decoding.loop import DecodeRun, default_compile_config
from transformers_drama3.decoding.request import RequestOptions, make_sampler, resolve_request
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.decoding.state import compiled_capacity
from transformers_drama3.placement.planning import GIB, plan_memory

PAPER_FRAMES_PER_SECOND = 271.0
"""The paper's Drama 3 decode speed on one H200 (batch 1)."""
PAPER_KERNELS_PER_STEP = 1278
PUBLISHED_LAYERS = 40
FIRST_AUDIO_FRAMES = 10
"""Frames of the time to first audio: the serving schedule's first codec window."""
PROFILED_FRAME = 5
"""The frame whose step is profiled (a compiled run replays its graphs from the third step on)."""
FP8_BLOCK = (128, 128)
EXPERT_FORMATS = ("bf16", "fp8")
MODES = ("compiled", "eager")
OTHER_MODES = ("in-order", "prefill-graphs")
"""Measured only when asked (`--modes`): each adds compiles at the published depth."""
FP8_MODULE = "transformers_drama3.checkpoint.quantization.fp8_expert_layer"

# A width that runs the same code in seconds on a CPU (--dry-run).
DRY_RUN_TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                    vocab_size=512 + 256)
DRY_RUN_TOWER = dict(dim=64, n_head=4, n_local_heads=2, head_dim=16, intermediate_size=128, vocab_size=256)
DRY_RUN_CODEC = dict(encoder_dim=8, encoder_rates=[2, 4], encoder_transformer_layers=[0, 1], encoder_transformer_window=8,
                     transformer_head_dim=16, quantizer_downsample_factors=[2, 2], quantizer_transformer_layers=1,
                     quantizer_transformer_dim=32, quantizer_transformer_heads=2,
                     quantizer_transformer_intermediate_size=64, quantizer_transformer_window=4,
                     semantic_codebook_size=256, residual_codebook_size=256, codebook_dim=4, decoder_dim=32,
                     decoder_rates=[4, 2])
DRY_RUN_LAYERS = 4
DEFAULTS = {"layers": (PUBLISHED_LAYERS, DRY_RUN_LAYERS), "batches": ((1, 8, 32, 64), (1, 2)), "frames": (64, 16),
            "prompt_rows": (256, 16)}
"""Each option's default: (measured, dry run)."""
MIN_LAYERS = 4
"""The fewest backbone layers that hold a full-attention layer (3 Gated DeltaNet : 1 attention)."""


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="backbone layers (default: the published 40; a dry run 4)")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="batch sizes, measured in this order (default 1 8 32 64; a dry run 1 2)")
    parser.add_argument("--frames", type=int, default=None,
                        help="frames per run, the first 10 the time to first audio (default 64; a dry run 16)")
    parser.add_argument("--prompt-rows", type=int, default=None, help="rows of each prompt (default 256; a dry run 16)")
    parser.add_argument("--experts", default="bf16", choices=EXPERT_FORMATS, help="the routed experts' format")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES + OTHER_MODES,
                        help="measured in this order for each batch (in-order: compiled, stepped by DecodeRun.steps(); "
                             "prefill-graphs: compiled, and the prefill too)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the numbers to PATH")
    parser.add_argument("--list-kernels", action="store_true",
                        help="print the profiled step's CUDA kernels (ATen ops on the CPU) by name after each row")
    parser.add_argument("--dry-run", action="store_true", help="a tiny width on the CPU: checks the script runs")
    arguments = parser.parse_args(argv)
    for name, (measured, dry) in DEFAULTS.items():
        if getattr(arguments, name) is None:
            value = dry if arguments.dry_run else measured
            setattr(arguments, name, list(value) if isinstance(value, tuple) else value)
    if not MIN_LAYERS <= arguments.layers <= PUBLISHED_LAYERS:
        parser.error(f"--layers {arguments.layers}: expected {MIN_LAYERS} to {PUBLISHED_LAYERS} (the decode cache "
                     f"needs a full-attention layer: the {MIN_LAYERS}th of every {MIN_LAYERS})")
    if any(batch < 1 for batch in arguments.batches):
        parser.error(f"--batches {' '.join(map(str, arguments.batches))}: expected positive batch sizes")
    if arguments.prompt_rows < 1:
        parser.error(f"--prompt-rows {arguments.prompt_rows}: expected a positive number of rows")
    if arguments.frames < FIRST_AUDIO_FRAMES + 2:
        # the first audio, then at least two timed steps (the one after the codec is not timed)
        parser.error(f"--frames {arguments.frames}: expected at least {FIRST_AUDIO_FRAMES + 2}")
    return arguments


# ----------------------------------------------------------------------------- the model


def published_config(layers: int, dry_run: bool) -> Drama3Config:
    """The published config (or the dry run's tiny width) with `layers` backbone layers."""
    text = dict(DRY_RUN_TEXT) if dry_run else {}
    text["num_hidden_layers"] = layers
    if dry_run:
        return Drama3Config(text_config=text, audio_decoder_config=DRY_RUN_TOWER, semantic_start_token_id=512,
                            eos_token_id=2)
    return Drama3Config(text_config=text)


def materialised(config: Drama3Config, device: str, dtype: torch.dtype, seed: int = 0) -> Drama3ForSpeechGeneration:
    """The model of `config` built on the meta device (no memory), then given storage on `device`
    in `dtype` and the model's own random initialisation there (`_init_weights` of every module,
    rotary tables included): the published shapes without ever holding them anywhere else."""
    with torch.device("meta"):
        model = Drama3ForSpeechGeneration._from_config(config, dtype=dtype)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    model.to_empty(device=device)
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    torch.manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            model._init_weights(module)
    left = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:5]}")
    return model.eval()


def without_eos(model: Drama3ForSpeechGeneration) -> Drama3ForSpeechGeneration:
    """`model` whose restricted logits never draw eos, so that every run makes all its frames
    (random weights would end a take at random)."""
    eos_index = model.config.codebook_size  # the restricted logits: the semantic band, then eos
    speech_logits = model.speech_logits

    def logits_without_eos(hidden):
        logits = speech_logits(hidden)
        # a mask made on the logits' device: a Python scalar written into `logits[..., eos]` would
        # be traced as a CPU tensor constant, and inductor would skip CUDA graphs for the step
        is_eos = torch.arange(logits.shape[-1], device=logits.device) == eos_index
        return logits.masked_fill(is_eos, float("-inf"))

    model.speech_logits = logits_without_eos
    return model


def fp8_quantizer():
    """The library's block-FP8 expert quantiser; SystemExit naming `--experts fp8` when it is not
    importable (checked before the model is built)."""
    try:
        from transformers_drama3.checkpoint.quantization.fp8_expert_layer import quantize_experts_fp8
    except ImportError as error:
        raise SystemExit(f"--experts fp8: {FP8_MODULE}.quantize_experts_fp8 is not importable ({error}); this "
                         f"benchmark keeps no FP8 experts of its own: run --experts bf16") from None
    return quantize_experts_fp8


def build(config: Drama3Config, device: str, dtype: torch.dtype, experts: str) -> Drama3ForSpeechGeneration:
    quantize = fp8_quantizer() if experts == "fp8" else None
    model = materialised(config, device, dtype)
    if quantize is not None:
        quantize(model, block_size=FP8_BLOCK)
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return without_eos(model)


def codec_of(dry_run: bool, device: str) -> Drama3CodecModel:
    """The S2 codec at the published shape with random weights (the dry run: a tiny one with the
    same ten codebooks), float32 as `Drama3Processor` keeps it."""
    config = Drama3CodecConfig(**DRY_RUN_CODEC) if dry_run else Drama3CodecConfig()
    torch.manual_seed(0)
    with torch.device(device):
        return Drama3CodecModel(config).float().eval()


# ----------------------------------------------------------------------------- what a step reads


def distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts of a layer that `tokens` tokens reach, each routed to `top_k` of
    `experts` uniformly at random."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


@lru_cache(maxsize=4)
def _weight_parts(config_json: str, experts: str) -> tuple[int, int]:
    """(bytes of the dense parts one step reads, bytes of every routed expert of every layer)."""
    config = Drama3Config(**json.loads(config_json))
    accounting = account(config)
    dense = accounting.backbone_bytes_per_frame + accounting.tower_bytes_per_frame
    quantization = "fp8" if experts == "fp8" else "none"
    return dense, plan_memory(config, quantization, dtype=torch.bfloat16).routed_experts


def weights_read_per_step(config: Drama3Config, experts: str, batch: int) -> int:
    """Bytes of weights one decode step of `batch` items reads (see the module docstring): the
    dense parts once (`accounting.account`: bf16 backbone without routed experts, restricted head,
    one embedding row, tower), the routed experts the batch reaches at the planner's bytes."""
    dense, every_expert = _weight_parts(config.to_json_string(), experts)
    text = config.text_config
    reached = distinct_experts(text.num_experts, text.num_experts_per_tok, batch)
    return dense + round(every_expert * reached / text.num_experts)


def batch_plan(config: Drama3Config, experts: str, batch: int, rows: int, prompt_rows: int, free_bytes: int | None = None):
    """The planner's `MemoryPlan` of a run of `batch` items: weights, codec, a compiled run's cache
    of `rows` rows per item, the prefill of `batch x prompt_rows` rows at once (its
    expert buffers) and the workspace allowance; judged against `free_bytes` when given."""
    quantization = "fp8" if experts == "fp8" else "none"
    gpu_gb = None if free_bytes is None else free_bytes / GIB
    return plan_memory(config, quantization, gpu_gb=gpu_gb, streams=batch, context=compiled_capacity(rows),
                       prefill_rows=batch * prompt_rows)


def batches_that_fit(config: Drama3Config, experts: str, batches: list[int], rows: int, prompt_rows: int,
                     free_bytes: int) -> tuple[list[int], list[str]]:
    """The batch sizes whose `batch_plan` fits `free_bytes` less the planner's 10% headroom, and a
    line naming each that does not."""
    kept, refused = [], []
    for batch in batches:
        plan = batch_plan(config, experts, batch, rows, prompt_rows, free_bytes)
        if plan.fits:
            kept.append(batch)
        else:
            refused.append(f"--experts {experts} batch {batch}: needs {plan.total / GIB:.1f} GiB (weights, codec, "
                           f"decode state of {batch} x {plan.context} rows, {plan.transients / GIB:.1f} GiB of a "
                           f"{plan.prefill_rows}-row prefill's transients and workspace) of the {plan.usable / GIB:.1f} "
                           f"GiB a run may use here ({free_bytes / GIB:.1f} GiB free, 10% kept)")
    return kept, refused


def copy_bandwidth(device: str, megabytes: int, repeats: int = 10) -> float:
    """Bytes a large device-to-device copy moves per second (each byte read and written: both
    counted, as bandwidth tests count a copy); best of `repeats`."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    moved = 2 * source.numel()
    del source, target
    return moved / best


# ----------------------------------------------------------------------------- CUDA-graph capture


class GraphsNotCaptured(RuntimeError):
    """torch ran some graph of the compiled step without capturing it as a CUDA graph."""


class CudagraphSkipLog(logging.Handler):
    """Collects torch's "skipping cudagraphs ..." log lines, each with the step function whose
    compile or call printed it (read off the call stack: the loop's `_step` / `_draw` / `_feed` line)."""

    LOGGERS = ("torch", "torch._inductor", "torch._dynamo")
    """Where the handler listens: torch's loggers for inductor and dynamo do not propagate to "torch"."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._seen: set[int] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "skipping cudagraphs" in message and id(record) not in self._seen:
            self._seen.add(id(record))
            self.lines.append(f"{graph_on_stack()}: {message.strip().splitlines()[0]}")

    def __enter__(self):
        self.lines.clear()
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc_info):
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


def graph_on_stack() -> str:
    """Which step function is being compiled or run: "step", "draw" or "feed" from the decode
    loop's line on the call stack; "a graph of the step" when none is."""
    for frame in reversed(traceback.extract_stack()):
        line = frame.line or ""
        if frame.filename.endswith("loop.py"):
            for name in ("step", "draw", "feed"):
                if f"self._{name}," in line:
                    return name
    return "a graph of the step"


def cudagraph_skips() -> int:
    """What torch counts as CUDA graphs skipped in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def capture_failures(label: str, skips: int, skip_lines: list[str], graph_launches: int | None,
                     expected_graphs: int = 1) -> list[str]:
    """Why the compiled step of `label` was not captured: `skips` CUDA graphs torch counted as
    skipped (with `skip_lines`, its log lines), or a profiled step that replayed no graph or more
    than `expected_graphs` (a step cut into partitions around host work). Empty when captured."""
    failures = [f"{label}, {line}" for line in skip_lines]
    if skips > len(skip_lines):
        failures.append(f"{label}: torch counted {skips} CUDA graph(s) skipped (cudagraph_skips), "
                        f"{len(skip_lines)} with a log line")
    if graph_launches is not None and graph_launches == 0:
        failures.append(f"{label}: the profiled step launched no CUDA graph (the step ran uncaptured)")
    elif graph_launches is not None and graph_launches > expected_graphs:
        failures.append(f"{label}: the profiled step launched {graph_launches} CUDA graphs, expected "
                        f"{expected_graphs} (the step, draw and feed in one): the step is cut into partitions around host work")
    return failures


def check_captured(failures: list[str]) -> None:
    """GraphsNotCaptured listing every failure, unless there are none."""
    if failures:
        raise GraphsNotCaptured("\n".join(f"NOT CAPTURED: {failure}" for failure in failures))


# ----------------------------------------------------------------------------- one measurement


@dataclass
class Row:
    experts: str
    mode: str
    batch: int
    ms_per_frame: float
    frames_per_second: float
    ops_per_step: int
    ops_counted: str
    graphs_per_step: int | None
    gb_per_step: float
    floor_ms: float
    times_floor: float
    ttfa_ms: float
    ttfa_codec_ms: float
    captured: str
    failures: list[str] = field(default_factory=list)
    graphs_compiled: int = 0
    """Graphs dynamo compiled during the warm-up run (json only)."""
    graphs_compiled_after_warm_up: int = 0
    """Graphs compiled during the timed and profiled runs: should be 0 (json only)."""
    guard_ms: float = 0.0
    """Host time of dynamo's guard checks in the profiled step (its `TorchDynamo Cache Lookup`
    events; 0 eagerly; the profiler's own overhead included; json only)."""
    host_ms: float = 0.0
    """Wall time of the profiled step's call before the wait for the device at its end: the host's
    work (launches, guards, the loop; the profiler's overhead included). On a GPU, a host_ms close
    to ms/frame says the step is bound by the host, not the GPU (json only)."""
    warm_up_s: float = 0.0
    """Wall time of the warm-up run (json only)."""
    compile_s: float = 0.0
    """The warm-up run's seconds less the timed run's (the same run, warm): what compiling, CUDA-graph
    capture and Triton's autotuning took (a compiled mode's first batch size, its symbolic graph at
    the second; json only)."""
    compile_cpu_s: float = 0.0
    """The same in this process's CPU time (all its threads): the work, whatever else shares the
    machine's cores (json only)."""
    peak_gib: float | None = None
    """On a GPU: the most memory torch's allocator reserved during the row's runs (json only)."""
    planned_gib: float | None = None
    """The planner's total for this batch (`batch_plan`; json only)."""
    step_ops: dict[str, int] = field(default_factory=dict)
    """The profiled step's CUDA kernels (on the CPU: top-level ATen ops) by name, with their counts
    (json only; printed by --list-kernels)."""


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def compile_config_of(mode: str, device: str) -> CompileConfig | None:
    """The step's compile options for `mode` on `device` (None: eager)."""
    if mode == "eager":
        return None
    if device.startswith("cuda"):
        return default_compile_config()
    # the same fullgraph trace (and dynamic shapes) on a CPU, run without code generation (no CUDA graphs there)
    return CompileConfig(fullgraph=True, dynamic=default_compile_config().dynamic, backend="aot_eager", mode=None)


def prompt(model, batch: int, rows: int, device: str):
    """A random text prompt [batch, rows] (no audio rows), its zero codes and its mask."""
    generator = torch.Generator().manual_seed(batch)
    input_ids = torch.randint(3, model.config.semantic_start_token_id, (batch, rows), generator=generator).to(device)
    audio_codes = torch.zeros(batch, rows, model.config.num_codebooks, dtype=torch.long, device=device)
    return input_ids, audio_codes, torch.ones_like(input_ids)


def prefilled_run(model, batch: int, rows: int, frames: int, device: str, compile_config: CompileConfig | None,
                  prefill_graphs: bool = False) -> DecodeRun:
    """A decode run of `frames` frames per item (the serving defaults' sampler, seed 0) with a random
    prompt of `rows` rows prefilled, through the library's public loop."""
    input_ids, audio_codes, mask = prompt(model, batch, rows, device)
    options = RequestOptions(SamplingSettings(), seed=0, max_new_tokens=frames, expected_seconds=frames / model.config.frame_rate)
    request = resolve_request(model, input_ids, mask, options)
    sampler = make_sampler(model, request)
    budgets = torch.full((batch,), frames, dtype=torch.long)
    return DecodeRun.prefilled(model, input_ids, audio_codes, mask, sampler, budgets, request.separators,
                               compile_config=compile_config, prefill_graphs=prefill_graphs)


def start_run(model, batch: int, rows: int, frames: int, mode: str, device: str) -> DecodeRun:
    """The prefilled run `mode` decodes."""
    return prefilled_run(model, batch, rows, frames, device, compile_config_of(mode, device),
                         prefill_graphs=mode == "prefill-graphs")


def stepped(run: DecodeRun, mode: str):
    """The steps of `run` as `mode` makes them."""
    return run.steps() if mode == "in-order" else run.steps_ahead()


def timed_run(model, codec, batch: int, rows: int, frames: int, mode: str, device: str) -> tuple[float, float, float]:
    """(seconds to the 10th frame, the same plus the codec decoding those frames, seconds per
    step after them). The step after the codec is not timed."""
    synchronize(device)
    started = time.perf_counter()
    steps = stepped(start_run(model, batch, rows, frames, mode, device), mode)
    first = []
    for _ in range(FIRST_AUDIO_FRAMES):
        first.append(next(steps).frames)
    first_audio = time.perf_counter() - started  # the frames are on the host (a step queued after them may run on)
    codes = torch.stack(first, dim=-1).to(device)  # [batch, num_codebooks, 10]; a step's frames are on the host
    codec.streaming_decoder(batch_size=batch).push(codes)
    synchronize(device)
    with_codec = time.perf_counter() - started
    next(steps)
    synchronize(device)
    resumed, timed = time.perf_counter(), 0
    for _ in steps:
        timed += 1
    synchronize(device)
    return first_audio, with_codec, (time.perf_counter() - resumed) / timed


@dataclass
class StepProfile:
    kernels: int
    """CUDA kernels (memcpy / memset not counted)."""
    aten_ops: int
    """Top-level ATen operator calls."""
    graph_launches: int
    guard_ms: float = 0.0
    """Time in dynamo's guard checks (`TorchDynamo Cache Lookup`)."""
    host_ms: float = 0.0
    """Wall time of the step's call before waiting for the device at its end."""
    names: dict[str, int] = field(default_factory=dict)
    """The kernels (on the CPU, the top-level ATen ops) by name, most frequent first."""


def is_kernel(name: str) -> bool:
    """Whether a device event of the profiler is a kernel: not a copy, a memset or a synchronisation
    ("Memcpy DtoD (Device -> Device)", "Memset (Device)", "Stream Sync", "Event Sync", ...)."""
    return not name.startswith(("Memcpy", "Memset")) and "Sync" not in name and "Wait" not in name


def profile_step(model, batch: int, rows: int, frames: int, mode: str, device: str) -> StepProfile:
    """What the profiler records during the step that makes frame `PROFILED_FRAME` of a fresh run."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    steps = stepped(start_run(model, batch, rows, frames, mode, device), mode)
    for _ in range(PROFILED_FRAME - 1):
        next(steps)
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as profiler:
        started = time.perf_counter()
        next(steps)
        host_ms = (time.perf_counter() - started) * 1e3
        synchronize(device)
    steps.close()
    events = profiler.events()

    def top_level_aten(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return event.name.startswith("aten::")

    def counted_op(event) -> bool:  # a kernel on a GPU, a top-level ATen op on the CPU
        if device.startswith("cuda"):
            return event.device_type == DeviceType.CUDA and is_kernel(event.name)
        return event.device_type == DeviceType.CPU and top_level_aten(event)

    counted = Counter(event.name for event in events if counted_op(event))
    return StepProfile(
        kernels=sum(1 for event in events if event.device_type == DeviceType.CUDA and is_kernel(event.name)),
        aten_ops=sum(1 for event in events if event.device_type == DeviceType.CPU and top_level_aten(event)),
        names=dict(counted.most_common()),
        graph_launches=sum(1 for event in events if event.device_type == DeviceType.CPU and "cudaGraphLaunch" in event.name),
        guard_ms=sum(event.cpu_time_total for event in events if event.name == "TorchDynamo Cache Lookup") / 1e3,
        host_ms=host_ms,
    )


def measure(model, codec, arguments, mode: str, batch: int, device: str, bandwidth: float, gb_per_step: float) -> Row:
    """One row: warm the shape (a whole run of the timed length), time a run, profile a step."""
    rows, frames = arguments.prompt_rows, arguments.frames
    on_gpu = device.startswith("cuda")
    skips_before, graphs_before = cudagraph_skips(), compiled_graphs()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad(), CudagraphSkipLog() as skip_log:
        started, cpu_started = time.perf_counter(), time.process_time()
        timed_run(model, codec, batch, rows, frames, mode, device)  # warm-up: compile, capture, autotune
        warm_up, warm_up_cpu = time.perf_counter() - started, time.process_time() - cpu_started
        compiled = compiled_graphs() - graphs_before
        started, cpu_started = time.perf_counter(), time.process_time()
        first_audio, with_codec, per_step = timed_run(model, codec, batch, rows, frames, mode, device)
        timed, timed_cpu = time.perf_counter() - started, time.process_time() - cpu_started
        profiled = profile_step(model, batch, rows, frames, mode, device)
        skip_lines = list(skip_log.lines)
    skips = cudagraph_skips() - skips_before
    recompiled = compiled_graphs() - graphs_before - compiled  # after the warm-up: a shape it did not cover
    label = f"{arguments.experts} {mode} batch {batch}"
    failures = []
    if mode != "eager" and on_gpu:
        failures = capture_failures(label, skips, skip_lines, profiled.graph_launches, 2 if mode == "in-order" else 1)
        captured = "no" if failures else "yes"
    else:
        captured = "n/a (eager)" if mode == "eager" else "n/a (CPU)"
    floor = gb_per_step * 1e9 / bandwidth
    return Row(
        experts=arguments.experts, mode=mode, batch=batch, ms_per_frame=per_step * 1e3,
        frames_per_second=batch / per_step,
        ops_per_step=profiled.kernels if on_gpu else profiled.aten_ops,
        ops_counted="CUDA kernels" if on_gpu else "aten ops",
        graphs_per_step=profiled.graph_launches if on_gpu else None,
        gb_per_step=gb_per_step, floor_ms=floor * 1e3, times_floor=per_step / floor,
        ttfa_ms=first_audio * 1e3, ttfa_codec_ms=with_codec * 1e3, captured=captured, failures=failures,
        graphs_compiled=compiled, graphs_compiled_after_warm_up=recompiled, guard_ms=profiled.guard_ms,
        host_ms=profiled.host_ms, warm_up_s=warm_up, compile_s=max(0.0, warm_up - timed),
        compile_cpu_s=max(0.0, warm_up_cpu - timed_cpu),
        peak_gib=torch.cuda.max_memory_reserved() / GIB if on_gpu else None, step_ops=profiled.names,
    )


# ----------------------------------------------------------------------------- printing

COLUMNS = ("experts", "mode", "batch", "ms/frame", "frames/s", "{ops}/step", "graphs/step", "GB/step", "floor ms",
           "x floor", "TTFA ms", "+codec ms", "captured")


def table_header(on_gpu: bool) -> str:
    names = [column.format(ops="kernels" if on_gpu else "aten ops") for column in COLUMNS]
    return "| " + " | ".join(names) + " |\n|" + "---|" * len(names)


def table_row(row: Row) -> str:
    graphs = "n/a (CPU)" if row.graphs_per_step is None else str(row.graphs_per_step)
    cells = [row.experts, row.mode, str(row.batch), f"{row.ms_per_frame:.2f}", f"{row.frames_per_second:.1f}",
             str(row.ops_per_step), graphs, f"{row.gb_per_step:.4g}", f"{row.floor_ms:.4g}", f"{row.times_floor:.1f}",
             f"{row.ttfa_ms:.1f}", f"{row.ttfa_codec_ms:.1f}", row.captured]
    return "| " + " | ".join(cells) + " |"


def row_notes(row: Row, on_gpu: bool, list_kernels: bool) -> list[str]:
    """The lines printed under a row: the compile time of a compiled mode, the memory against the
    plan on a GPU, and with `list_kernels` the step's kernels (ATen ops on the CPU) by name."""
    label = f"{row.experts} {row.mode} batch {row.batch}"
    notes = []
    if row.mode != "eager":
        notes.append(f"  {label}: compile, capture and autotuning {row.compile_s:.1f} s ({row.compile_cpu_s:.1f} s of CPU; "
                     f"the warm-up's {row.warm_up_s:.1f} s less the timed run's); {row.graphs_compiled} graph(s) compiled")
    if on_gpu and row.peak_gib is not None:
        notes.append(f"  {label}: peak {row.peak_gib:.1f} GiB reserved; planned {row.planned_gib:.1f} GiB "
                     f"(weights, state, prefill transients, workspace)")
    if list_kernels:
        kind = "CUDA kernels" if on_gpu else "ATen ops"
        notes.append(f"  {label}: {sum(row.step_ops.values())} {kind} in one step, {len(row.step_ops)} distinct:")
        notes += [f"    {count:5d}  {name}" for name, count in row.step_ops.items()]
    return notes


def write_json(path: str | None, header: dict, rows: list[Row]) -> None:
    if path is None:
        return
    with open(path, "w", encoding="utf-8") as writer:
        json.dump({**header, "rows": [asdict(row) for row in rows]}, writer, indent=1)


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    started = time.perf_counter()
    if arguments.dry_run:
        device, dtype = "cpu", torch.float32
        torch.set_num_threads(1)  # a tiny width gains nothing from threads (see decoding/threads.py)
    elif torch.cuda.is_available():
        device, dtype = "cuda", torch.bfloat16
    else:
        raise SystemExit("benchmarks/gpu.py: no CUDA device; run with --dry-run to check the script on the CPU")
    if arguments.experts == "fp8":
        fp8_quantizer()  # refused before anything is built
    on_gpu = device == "cuda"
    name = torch.cuda.get_device_name() if on_gpu else "CPU (dry run: tiny width, float32 for bf16)"
    config = published_config(arguments.layers, arguments.dry_run)
    if on_gpu:  # refused before minutes of building and compiling end in an out-of-memory error
        rows = arguments.prompt_rows + arguments.frames + 2
        arguments.batches, refused = batches_that_fit(config, arguments.experts, arguments.batches, rows,
                                                      arguments.prompt_rows, torch.cuda.mem_get_info()[0])
        for line in refused:
            print(f"NOT MEASURED: {line}", flush=True)
        if not arguments.batches:
            raise SystemExit(f"benchmarks/gpu.py: no batch size fits this GPU with --experts {arguments.experts} "
                             f"(see above): run --experts fp8, or on a GPU with more memory")
    bandwidth = copy_bandwidth(device, 4096 if on_gpu else 64)
    header = {"device": name, "torch": torch.__version__, "layers": arguments.layers, "experts": arguments.experts,
              "prompt_rows": arguments.prompt_rows, "frames": arguments.frames, "copy_bandwidth_gb_per_s": bandwidth / 1e9}
    print(f"{name}, torch {torch.__version__}; {arguments.layers} backbone layers, {arguments.experts} routed experts; "
          f"prompt {arguments.prompt_rows} rows, {arguments.frames} frames per run; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s (read + written); the paper: {PAPER_FRAMES_PER_SECOND:.0f} frames/s at batch 1, "
          f"{PAPER_KERNELS_PER_STEP:,} kernels per step", flush=True)
    model = build(config, device, dtype, arguments.experts)
    codec = codec_of(arguments.dry_run, device)
    header["build_s"] = time.perf_counter() - started
    print(f"  built in {header['build_s']:.0f} s", flush=True)
    # dynamo keeps 8 compiled variants of a function by default; each batch size is at most one variant
    # of `step` (automatic dynamic shapes: batch 1's, then one symbolic graph for the others; in-order:
    # of `draw` and of `feed`; prefill-graphs: one prefill per bucket): room for twice that
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(arguments.batches))
    print(table_header(on_gpu), flush=True)
    rows, failures = [], []
    for batch in arguments.batches:  # a run cut short by a time limit has every mode of its first batches
        gb_per_step = weights_read_per_step(config, arguments.experts, batch) / 1e9
        for mode in arguments.modes:
            row = measure(model, codec, arguments, mode, batch, device, bandwidth, gb_per_step)
            row.planned_gib = batch_plan(config, arguments.experts, batch, arguments.prompt_rows + arguments.frames + 2,
                                         arguments.prompt_rows).total / GIB
            rows.append(row)
            failures += row.failures
            print(table_row(row), flush=True)
            for failure in row.failures:
                print(f"NOT CAPTURED: {failure}", flush=True)
            for note in row_notes(row, on_gpu, arguments.list_kernels):
                print(note, flush=True)
            write_json(arguments.json, {**header, "seconds": time.perf_counter() - started}, rows)
    print(f"  ({time.perf_counter() - started:.0f} s in all)", flush=True)
    try:
        check_captured(failures)
    except GraphsNotCaptured as error:
        print(error, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()

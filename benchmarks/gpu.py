"""Drama 3 decode speed on one GPU at the published width (random weights), in under ten minutes.

    PYTHONPATH=src python benchmarks/gpu.py                 # on a CUDA machine (one H200: ~5 min)
    PYTHONPATH=src python benchmarks/gpu.py --dry-run       # the same code at a tiny width, CPU, seconds

The published model is too large to build at all 40 backbone layers in a few minutes, so each
measurement builds the published width (hidden 2048, 256 experts of which 8 per token, the
13-layer tower, the full vocabulary) at two backbone depths (`--depths`, default 4 and 8 layers,
keeping the 3 Gated DeltaNet : 1 attention pattern) and extrapolates the time per step linearly to
the published 40 layers: step(40) = step(a) + (40 - a) / (b - a) * (step(b) - step(a)).

For each expert format (bf16; FP8: the routed experts stored as float8 e4m3 with one scale per
output row, the experts each token reaches gathered and dequantised to bf16, so each step reads one
byte per expert weight it uses - weight-only FP8, not the published block-scaled FP8 matmul) and
each mode it prints for batch 1 and `--batch`. The modes (`--modes`):

  eager     the reference decode loop (dynamic caches that grow by a row per step);
  static    the static decode step (`cache_implementation="static"`: preallocated caches, fixed
            shapes), not compiled;
  graph     the static step captured whole by `torch.compile(fullgraph=True)` with the
            `cudagraphs` backend: one CUDA graph replayed per step, no code generation, so it
            builds in seconds (`aot_eager` on the dry run's CPU);
  compiled  the static step through inductor with CUDA graphs (`mode="reduce-overhead"`, what
            `generate(cache_implementation="static")` does on a GPU by default); inductor's
            compile takes minutes per depth and batch size, so it is not in the default modes.

It prints:

  ms per step, frames/s of all items, and frames/s against the paper's 271 frames/s (one H200,
  batch 1) and S2's 177,

plus the time to first audio of one stream (prefill of `--prompt-rows` rows + 10 frames, without
the codec) at the published depth (extrapolated the same way). eos is masked out, so every run
makes exactly `--frames` frames. Prints only; asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration
from transformers import CompileConfig

from transformers_drama3.decoding.loop import DecodeRun, default_compile_config
from transformers_drama3.decoding.sampler import Drama3Sampler, SamplingSettings, prompt_window

PAPER_FRAMES_PER_SECOND = 271.0
"""The paper's Drama 3 decode speed on one H200 (batch 1)."""
S2_FRAMES_PER_SECOND = 177.0
"""The paper's figure for Fish Audio S2 on the same GPU."""
PUBLISHED_LAYERS = 40
FIRST_AUDIO_FRAMES = 10

# A width that runs the same code in seconds on a CPU (--dry-run).
DRY_RUN_TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                    vocab_size=512 + 256)
DRY_RUN_TOWER = dict(dim=64, n_head=4, n_local_heads=2, head_dim=16, intermediate_size=128, vocab_size=256)

MODES = ("eager", "static", "graph", "compiled")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", nargs=2, type=int, default=[4, 8],
                        help="two backbone depths to extrapolate from (multiples of 4)")
    parser.add_argument("--batch", type=int, default=16, help="the batched run's size (batch 1 always runs)")
    parser.add_argument("--frames", type=int, default=32, help="frames per timed run")
    parser.add_argument("--prompt-rows", type=int, default=256)
    parser.add_argument("--experts", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    parser.add_argument("--modes", nargs="+", default=["eager", "graph"], choices=list(MODES))
    parser.add_argument("--dry-run", action="store_true", help="a tiny width on the CPU: checks the script runs")
    arguments = parser.parse_args(argv)
    low, high = arguments.depths
    if not (0 < low < high and low % 4 == 0 and high % 4 == 0):
        # whole groups of 3 Gated DeltaNet + 1 attention layers: the mix of the published 40
        parser.error(f"--depths {low} {high}: expected two multiples of 4, the first smaller")
    for name in ("batch", "frames", "prompt_rows"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(arguments, name)}: expected a positive number")
    if arguments.frames < 2:
        parser.error("--frames: at least 2 (the first frame includes the prefill)")
    return arguments


def published_config(layers: int, dry_run: bool) -> Drama3Config:
    """The published config (or the dry run's tiny width) with `layers` backbone layers."""
    text = dict(DRY_RUN_TEXT) if dry_run else {}
    text["num_hidden_layers"] = layers
    if dry_run:
        return Drama3Config(text_config=text, audio_decoder_config=DRY_RUN_TOWER, semantic_start_token_id=512,
                            eos_token_id=2)
    return Drama3Config(text_config=text)


def build(layers: int, device: str, dtype: torch.dtype, dry_run: bool) -> Drama3ForSpeechGeneration:
    """A random model at the published width; eos masked out of the restricted logits."""
    config = published_config(layers, dry_run)
    with torch.device(device):
        model = Drama3ForSpeechGeneration(config).to(dtype).eval()
    eos_index = config.codebook_size
    speech_logits = model.speech_logits

    def without_eos(hidden):
        logits = speech_logits(hidden)
        # a mask on the logits' device: writing the Python scalar into `logits[..., eos]` traced as a
        # CPU tensor constant, and torch skipped CUDA graphs for the whole step
        is_eos = torch.arange(logits.shape[-1], device=logits.device) == eos_index
        return logits.masked_fill(is_eos, float("-inf"))

    model.speech_logits = without_eos
    return model


class Fp8StoredExperts(torch.nn.Module):
    """The routed experts of one layer stored in float8 e4m3 with one float32 scale per output row;
    a step dequantises only the experts its tokens reach. Same maths as transformers' eager experts."""

    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        self.num_experts, self.act_fn = experts.num_experts, experts.act_fn
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name).data
            scale = weight.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            self.register_buffer(f"{name}_fp8", (weight.float() / scale).to(torch.float8_e4m3fn))
            self.register_buffer(f"{name}_scale", scale)
        self.compute_dtype = experts.gate_up_proj.dtype

    def weight(self, name: str, expert: int) -> torch.Tensor:
        stored, scale = getattr(self, f"{name}_fp8")[expert], getattr(self, f"{name}_scale")[expert]
        return (stored.to(torch.float32) * scale).to(self.compute_dtype)

    def gathered(self, name: str, experts: torch.Tensor) -> torch.Tensor:
        """The weights of `experts` [S] dequantised: [S, out, in] in the compute dtype."""
        stored, scale = getattr(self, f"{name}_fp8")[experts], getattr(self, f"{name}_scale")[experts]
        return (stored.to(torch.float32) * scale).to(self.compute_dtype)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """hidden_states [tokens, hidden], top_k_index / top_k_weights [tokens, k]: every (token,
        expert) pair as one batched matmul, fixed shapes (a graph captures it whole)."""
        tokens, top_k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        pairs = hidden_states.repeat_interleave(top_k, dim=0)  # [S, hidden]
        gate, up = torch.bmm(self.gathered("gate_up_proj", experts), pairs[..., None])[..., 0].chunk(2, -1)
        expert_out = torch.bmm(self.gathered("down_proj", experts), (self.act_fn(gate) * up)[..., None])[..., 0]
        weighted = expert_out * top_k_weights.reshape(-1, 1).to(expert_out.dtype)
        return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def store_experts_in_fp8(model: Drama3ForSpeechGeneration) -> None:
    for layer in model.backbone.layers:
        layer.mlp.experts = Fp8StoredExperts(layer.mlp.experts)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compile_config_of(mode: str, device: str) -> CompileConfig | None:
    """The static step's compile options for `mode` on `device` (None: not compiled)."""
    on_gpu = device.startswith("cuda")
    if mode == "graph":
        return CompileConfig(fullgraph=True, dynamic=False, backend="cudagraphs" if on_gpu else "aot_eager", mode=None)
    if mode == "compiled":
        return default_compile_config() if on_gpu else CompileConfig(fullgraph=True, dynamic=False, mode=None)
    return None


def steps_of(model, input_ids, audio_codes, mask, sampler, budgets, mode: str, device: str):
    compile_config = None if mode == "eager" else compile_config_of(mode, device)
    return DecodeRun.prefilled(model, input_ids, audio_codes, mask, sampler, budgets, compile_config=compile_config).steps()


OP_COUNT_DEPTHS = (4, 8)
"""Backbone depths the op count of a step is measured at (whole groups of 3 Gated DeltaNet + 1
attention layers); the count per layer is their difference, extrapolated to the published 40."""


def step_reports(model, seed: int = 0, draw: bool = True) -> list:
    """`capture_check` reports of one decode step of `model` on the CPU, `draw` (unless `draw` is
    False) then `feed`: batch 1, a 16-row prompt, the serving sampling defaults (top-p 0.9, RAS), seeded."""
    from transformers_drama3.decoding import step as decode_step
    from transformers_drama3.decoding.request import make_sampler
    from transformers_drama3.decoding.request import resolve_request as _resolve_request
    from transformers_drama3.kernels.capture_check import capture_report

    config = model.config
    input_ids = torch.randint(3, config.semantic_start_token_id, (1, 16), generator=torch.Generator().manual_seed(seed))
    audio_codes = torch.zeros(1, 16, config.num_codebooks, dtype=torch.long)
    mask = torch.ones_like(input_ids)
    request = _resolve_request(model, SamplingSettings(), input_ids, mask, 20, 1.0, None)
    sampler = make_sampler(model, request, input_ids, mask, seed)
    noise = sampler.step_noise(1, sampler.candidate_ids.shape[0], config.num_codebooks, input_ids.device)
    row = torch.full((1,), config.semantic_start_token_id), torch.zeros(1, config.num_codebooks, dtype=torch.long)
    with torch.no_grad():
        run = DecodeRun.prefilled(model, input_ids, audio_codes, mask, sampler, request.budgets, request.separators,
                                  compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None))
    cache = run.cache
    reports = []
    if draw:
        cache.open_window(cache.tower_part, 1)
        reports.append(capture_report(decode_step.draw, model, cache, sampler, run.state, noise, None))
    cache.open_window(cache.backbone_part, 1)
    return [*reports, capture_report(decode_step.feed, model, cache, run.state, *row)]


def print_step_op_count() -> None:
    """Ops per decode step at the published depth, from `capture_check` on the CPU: the dry run's
    model (the published structure: 10 codebooks, the published tower and layer pattern, at a tiny
    width) at two backbone depths, the per-layer count extrapolated to 40 layers. The step has
    fixed shapes, so the count does not depend on widths or expert counts (the same at twice the
    width and at 256 experts, 8 per token). Aten ops before inductor fuses them: an upper bound on
    the kernels of a step, not a kernel count."""
    low, high = OP_COUNT_DEPTHS
    capturable = True
    feeds = {}
    for depth in OP_COUNT_DEPTHS:
        torch.manual_seed(0)
        model = Drama3ForSpeechGeneration(published_config(depth, dry_run=True)).eval()
        # the draw (restricted head, sampler, tower) does not depend on the backbone's depth
        reports = step_reports(model, draw=depth == low)
        if depth == low:
            draw = reports[0].ops
        feeds[depth] = reports[-1].ops
        capturable = capturable and all(report.capturable for report in reports)
        for line in (line for report in reports for line in report.problems()):
            print(f"    not capturable: {line}")
    per_layer = (feeds[high] - feeds[low]) / (high - low)
    total = draw + extrapolate((low, feeds[low]), (high, feeds[high]))
    print(f"  ops per decode step (aten ops before fusion, batch 1, top-p + RAS): {total:.0f} at {PUBLISHED_LAYERS} "
          f"layers = {draw} (draw) + {feeds[low]} (feed at {low} layers) + {per_layer:.2f} per further backbone layer; "
          f"{'each graph capturable' if capturable else 'NOT capturable'} (the paper: 1,278 kernels)", flush=True)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_run(model, batch: int, rows: int, frames: int, device: str, mode: str = "eager") -> tuple[float, float]:
    """(seconds to the 10th frame from the start, including the prefill; seconds per step after it)."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, model.config.semantic_start_token_id, (batch, rows), generator=generator).to(device)
    audio_codes = torch.zeros(batch, rows, model.config.num_codebooks, dtype=torch.long, device=device)
    mask = torch.ones_like(input_ids)
    sampler = Drama3Sampler(SamplingSettings(), model.speech_token_ids(device), prompt_window(input_ids, mask))
    budgets = torch.full((batch,), max(frames, FIRST_AUDIO_FRAMES))
    steps = steps_of(model, input_ids, audio_codes, mask, sampler, budgets, mode, device)
    synchronize(device)
    started = time.perf_counter()
    first_audio = float("nan")
    marks = []
    for index, _ in enumerate(steps):
        synchronize(device)
        marks.append(time.perf_counter())
        if index + 1 == FIRST_AUDIO_FRAMES:
            first_audio = marks[-1] - started
    per_step = (marks[-1] - marks[0]) / max(len(marks) - 1, 1)
    return first_audio, per_step


def extrapolate(low: tuple[int, float], high: tuple[int, float], layers: int = PUBLISHED_LAYERS) -> float:
    """The value at `layers` on the line through (depth, value) pairs `low` and `high`."""
    (a, at_a), (b, at_b) = low, high
    return at_a + (layers - a) / (b - a) * (at_b - at_a)


def measure(arguments, depth: int, experts: str, mode: str, device: str, dtype) -> dict[int, tuple[float, float]]:
    """{batch: (time to first audio, seconds per step)} of one model."""
    torch.manual_seed(0)
    model = build(depth, device, dtype, arguments.dry_run)
    if experts == "fp8":
        store_experts_in_fp8(model)
    results = {}
    torch._dynamo.reset()  # a fresh model: nothing compiled for another one stays around
    with torch.no_grad():
        timed_run(model, 1, 16, 3, device)  # warm-up
        for batch in sorted({1, arguments.batch}):
            if mode != "eager":
                # the same batch and cache length class as the timed run: compiles / captures it
                timed_run(model, batch, arguments.prompt_rows, 3, device, mode)
            results[batch] = timed_run(model, batch, arguments.prompt_rows, arguments.frames, device, mode)
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return results


def report(experts: str, mode: str, low_depth: int, high_depth: int, low: dict, high: dict, layers: int) -> None:
    for batch in low:
        per_step = extrapolate((low_depth, low[batch][1]), (high_depth, high[batch][1]), layers)
        first_audio = extrapolate((low_depth, low[batch][0]), (high_depth, high[batch][0]), layers)
        frames_per_second = batch / per_step
        print(
            f"  {experts:>4} {mode:>8} batch {batch:>2}: {per_step * 1e3:7.2f} ms per step at {layers} layers "
            f"({low[batch][1] * 1e3:.2f} at {low_depth}, {high[batch][1] * 1e3:.2f} at {high_depth}); "
            f"{frames_per_second:7.1f} frames/s = {frames_per_second / PAPER_FRAMES_PER_SECOND:.2f}x the paper's "
            f"{PAPER_FRAMES_PER_SECOND:.0f}, {frames_per_second / S2_FRAMES_PER_SECOND:.2f}x S2's {S2_FRAMES_PER_SECOND:.0f}; "
            f"first audio {first_audio * 1e3:.0f} ms"
        )


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    started = time.perf_counter()
    if arguments.dry_run:
        device, dtype = "cpu", torch.float32
        torch.set_num_threads(1)  # a tiny width gains nothing from threads (see threads.py)
    elif torch.cuda.is_available():
        device, dtype = "cuda", torch.bfloat16
    else:
        raise SystemExit("benchmarks/gpu.py: no CUDA device; run with --dry-run to check the script on the CPU")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run: tiny width, float32 for bf16)"
    low_depth, high_depth = arguments.depths
    print(f"{name}, torch {torch.__version__}; backbone depths {low_depth} and {high_depth} extrapolated to "
          f"{PUBLISHED_LAYERS}; prompt {arguments.prompt_rows} rows, {arguments.frames} frames per run")
    if arguments.dry_run:
        print_step_op_count()
    for experts in arguments.experts:
        for mode in arguments.modes:
            low = measure(arguments, low_depth, experts, mode, device, dtype)
            high = measure(arguments, high_depth, experts, mode, device, dtype)
            report(experts, mode, low_depth, high_depth, low, high, PUBLISHED_LAYERS)
            print(f"    ({time.perf_counter() - started:.0f} s so far)", flush=True)


if __name__ == "__main__":
    main()

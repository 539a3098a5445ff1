"""Decode speed of Drama 3 generation on this machine (random weights, float32), in one run.

    PYTHONPATH=src python benchmarks/generate.py [--configs small medium] [--batches 1 4 16]
                                                 [--frames 16] [--prompt-rows 128] [--no-codec]
                                                 [--no-busy] [--busy-seconds 120] [--no-compile]
                                                 [--static-batches 1 16]

For each config prints:
  - ATen ops and dtype casts (`_to_copy`) of one decode step (batch 1), counted by a dispatch mode;
  - the static decode step (`cache_implementation="static"`) against the eager loop, at batch 1
    and 16 (`--static-batches`): its ATen ops per step, ms per step eager on fixed shapes, and compiled by `torch.compile(fullgraph=True)`
    (the graph's ops and the kernels inductor made of them; compile time is printed apart and not
    counted); skipped with `--no-compile`;
  - decode ms per frame at 1 thread, torch's default count and the count `threads.decode_threads`
    chooses, on the machine as it is and with one core kept busy by a spinner process (a child
    that spins for at most `--busy-seconds`, killed when the comparison ends);
  - prefill time of one prompt of `--prompt-rows` rows;
  - frames per second of batches of 1, 4 and 16 (frames of all items / time) against the
    memory-bandwidth floor of that batch: the bytes of weights one step reads (backbone without
    the routed experts, the routed experts the batch's tokens reach - top-k of each token,
    `E (1 - (1 - k/E)^B)` distinct experts expected for B tokens - the restricted lm_head rows,
    the tower and its heads) divided by the copy bandwidth measured here, and the part of the
    step the floor leaves (per-op overhead and compute);
  - time to first audio of one stream: prefill + the first 10-frame window + its codec decode.
eos is masked out so every run makes exactly `--frames` frames. Prints only; asserts nothing.
"""

import argparse
import collections
import subprocess
import sys
import time

import torch
from torch._inductor import metrics
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import CompileConfig

from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration
from transformers_drama3.decoding import step as decode_step
from transformers_drama3.decoding.loop import DecodeRun
from transformers_drama3.decoding.request import RequestOptions, make_sampler, resolve_request
from transformers_drama3.decoding.threads import available_cores, busy_cores_elsewhere, decode_threads, torch_threads

CONFIGS = {
    # ~20M parameters: the tiny test model's shape, a little wider
    "small": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2, expert_size=256,
                  tower_ffn=512, codebook=1024, vocab=2048),
    # ~0.9B parameters: 1/2 of the published width, 8 of 40 layers, the published codebooks
    "medium": dict(hidden=1024, layers=8, heads=8, kv_heads=2, head_dim=128, experts=64, top_k=8, expert_size=256,
                   tower_ffn=3072, codebook=4096, vocab=8192),
}


def build(name: str) -> Drama3ForSpeechGeneration:
    size = CONFIGS[name]
    text = dict(
        hidden_size=size["hidden"], num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"], head_dim=size["head_dim"], vocab_size=size["vocab"] + size["codebook"],
        linear_num_key_heads=size["heads"], linear_num_value_heads=2 * size["heads"], linear_key_head_dim=size["head_dim"],
        linear_value_head_dim=size["head_dim"], num_experts=size["experts"], num_experts_per_tok=size["top_k"],
        moe_intermediate_size=size["expert_size"], shared_expert_intermediate_size=size["expert_size"],
        max_position_embeddings=4096,
    )
    tower = dict(dim=size["hidden"], n_head=size["heads"], n_local_heads=size["kv_heads"], head_dim=size["head_dim"],
                 intermediate_size=size["tower_ffn"], vocab_size=size["codebook"], num_codebooks=10)
    config = Drama3Config(text_config=text, audio_decoder_config=tower, semantic_start_token_id=size["vocab"],
                          eos_token_id=2)
    model = Drama3ForSpeechGeneration(config).float().eval()
    eos_index = config.codebook_size  # the restricted logits end with eos: mask it so runs never stop early
    speech_logits = model.speech_logits

    def without_eos(hidden):
        logits = speech_logits(hidden)
        logits[..., eos_index] = float("-inf")
        return logits

    model.speech_logits = without_eos
    return model


def distinct_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens reach, each routed to `top_k` of `experts` at random."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def weights_read_per_step(model: Drama3ForSpeechGeneration, batch: int = 1) -> int:
    """Bytes of parameters one decode step of `batch` items reads (each weight once per step)."""
    text = model.config.text_config
    element = next(model.parameters()).element_size()
    expert_share = distinct_experts(text.num_experts, text.num_experts_per_tok, batch) / text.num_experts
    total = 0
    for name, parameter in model.named_parameters():
        if name.startswith(("lm_head", "audio_decoder.codebook_embeddings")) or "embed_tokens" in name:
            continue
        if "embedding" in name:  # tower embeddings: one row per item
            total += batch * parameter.shape[-1] * element
        elif ".mlp.experts." in name:
            total += int(parameter.numel() * element * expert_share)
        else:
            total += parameter.numel() * element
    rows = model.config.codebook_size + 1
    total += rows * model.config.hidden_size * element  # restricted lm_head
    total += batch * (1 + model.config.num_codebooks) * model.config.hidden_size * element  # embedding rows
    return total


def copy_bandwidth(megabytes: int = 512) -> float:
    """Bytes read per second by a large tensor copy (best of 5)."""
    source = torch.empty(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return source.numel() * 4 / best


def prompt_of(model, batch: int, rows: int):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, model.config.semantic_start_token_id, (batch, rows), generator=generator)
    return input_ids, torch.zeros(batch, rows, model.config.num_codebooks, dtype=torch.long), torch.ones_like(input_ids)


COMPILED = CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode=None)
"""The CPU's compile: one graph per step (CUDA graphs are a GPU's; `benchmarks/gpu.py`)."""


def steps_of(model, input_ids, audio_codes, mask, sampler, budgets, path: str):
    """The decode steps of one path: "eager" (the one step as it is) or "compiled" (the same step
    through `torch.compile`, on a power-of-two capacity), as `generate()` steps them (`steps_ahead`)."""
    compile_config = COMPILED if path == "compiled" else None
    return DecodeRun.prefilled(model, input_ids, audio_codes, mask, sampler, budgets, compile_config=compile_config).steps_ahead()


def sampler_of(model, input_ids, mask, frames: int):
    """(sampler, budgets [batch]) of a prompt decoded for `frames` frames with the serving defaults,
    as `generate()` resolves them."""
    options = RequestOptions(max_new_tokens=frames, expected_seconds=frames / model.config.frame_rate)
    request = resolve_request(model, input_ids, mask, options)
    return make_sampler(model, request), request.budgets


def run(model, batch: int, rows: int, frames: int, path: str = "eager") -> tuple[float, float]:
    """(prefill seconds, decode seconds) for `frames` frames of a batch."""
    input_ids, audio_codes, mask = prompt_of(model, batch, rows)
    sampler, budgets = sampler_of(model, input_ids, mask, frames)
    started = time.perf_counter()
    steps = steps_of(model, input_ids, audio_codes, mask, sampler, budgets, path)
    next(steps)  # prefill + first frame
    first = time.perf_counter()
    for _ in steps:
        pass
    done = time.perf_counter()
    per_frame = (done - first) / max(frames - 1, 1)
    return first - started - per_frame, per_frame


def time_to_first_audio(model, rows: int) -> float:
    from transformers_drama3.codec import Drama3CodecConfig, Drama3CodecModel

    codec = Drama3CodecModel(Drama3CodecConfig(semantic_codebook_size=model.config.codebook_size)).eval()
    input_ids, audio_codes, mask = prompt_of(model, 1, rows)
    for chunk in model.stream(input_ids, audio_codes, mask, codec=codec, seed=0, max_new_tokens=10, threads=None):
        return chunk.elapsed
    return float("nan")


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(model, path: str = "eager") -> tuple[int, int]:
    """(ATen ops, `_to_copy` casts) of one decode step of batch 1, after a few warm steps."""
    input_ids, audio_codes, mask = prompt_of(model, 1, 16)
    sampler, budgets = sampler_of(model, input_ids, mask, 8)
    steps = steps_of(model, input_ids, audio_codes, mask, sampler, budgets, path)
    next(steps), next(steps)
    counter = OpCounter()
    with counter:
        next(steps)
    return sum(counter.ops.values()), counter.ops[torch.ops.aten._to_copy]


def graph_of_one_step(model) -> tuple[int, int, int]:
    """(graphs, graph breaks, ops in the graphs) of one step (`draw` + `feed`), as
    `torch._dynamo.explain` sees them."""
    input_ids, audio_codes, mask = prompt_of(model, 1, 16)
    sampler, budgets = sampler_of(model, input_ids, mask, 8)
    run = DecodeRun.prefilled(model, input_ids, audio_codes, mask, sampler, budgets)
    run.cache.mark_static()
    for part in run.cache.parts:
        run.cache.open_window(part, 1)
    draw = torch._dynamo.explain(decode_step.draw)(model, run.cache, sampler, run.state, None)
    frames = torch.zeros(1, model.config.num_codebooks, dtype=torch.long)
    feed = torch._dynamo.explain(decode_step.feed)(model, run.cache, run.state, torch.tensor([1]), frames)
    return draw.graph_count + feed.graph_count, draw.graph_break_count + feed.graph_break_count, draw.op_count + feed.op_count


def static_comparison(model, frames: int, rows: int, batches: list[int], compile_it: bool) -> None:
    """The step compiled against the same step eager, at the current thread count, per batch size."""
    graphs, breaks, graph_ops = graph_of_one_step(model)
    print(f"  the step (draw + feed), torch._dynamo: {graphs} graph(s), {breaks} graph break(s), "
          f"{graph_ops} ops in the graphs")
    for batch in batches:
        eager = run(model, batch, rows, frames, "eager")[1]
        shown = f"  batch {batch:>2}, ms per step: eager {eager * 1e3:.1f}"
        if compile_it:
            torch._dynamo.reset()
            metrics.reset()
            started = time.perf_counter()
            run(model, batch, rows, 2, "compiled")  # compiles (same batch and cache length class as the timed run)
            compile_seconds = time.perf_counter() - started
            kernels = metrics.generated_kernel_count
            compiled = run(model, batch, rows, frames, "compiled")[1]
            shown += (f", compiled {compiled * 1e3:.1f} ({eager / compiled:.2f}x)  [speed vs eager; compile "
                      f"{compile_seconds:.0f} s, {kernels} generated kernels]")
        print(shown)


SPINNER = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"


def busy_core(seconds: float) -> subprocess.Popen:
    """A child process that keeps one core busy for at most `seconds` (the caller kills it sooner)."""
    return subprocess.Popen([sys.executable, "-c", SPINNER.format(seconds=seconds)])


def per_frame_at(model, threads: int, frames: int, rows: int) -> float:
    with torch_threads(threads):
        return run(model, 1, rows, frames)[1]


def thread_comparison(model, frames: int, rows: int, label: str) -> None:
    """ms per frame (batch 1) at 1 thread, torch's default and the chosen count."""
    chosen = decode_threads(model)
    default = available_cores()
    counts = {"1 thread": 1, f"default ({default})": default, f"chosen ({chosen})": chosen}
    timings = {name: per_frame_at(model, count, frames, rows) for name, count in counts.items()}
    one = timings["1 thread"]
    shown = ", ".join(f"{name} {value * 1e3:.1f} ms ({one / value:.2f}x)" for name, value in timings.items())
    print(f"  {label}: {shown}  [speed vs 1 thread]")


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--prompt-rows", type=int, default=128)
    parser.add_argument("--no-codec", action="store_true", help="skip the time-to-first-audio run")
    parser.add_argument("--no-busy", action="store_true", help="skip the comparison with a busy core")
    parser.add_argument("--busy-seconds", type=float, default=120.0, help="the spinner's longest life")
    parser.add_argument("--no-compile", action="store_true", help="time the static step eager only (compiling takes minutes)")
    parser.add_argument("--static-batches", nargs="+", type=int, default=[1, 16],
                        help="batch sizes of the static-step comparison (each compiles once)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{available_cores()} cores, {busy_cores_elsewhere()} busy with other processes now; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s read; torch {torch.__version__}")
    for name in args.configs:
        torch.manual_seed(0)
        model = build(name)
        parameters = sum(p.numel() for p in model.parameters())
        print(f"\n[{name}] {parameters / 1e6:.0f}M parameters, {weights_read_per_step(model) / 1e6:.0f} MB of weights "
              f"read per frame (batch 1)")
        run(model, 1, 8, 2)  # warm-up
        ops, casts = ops_per_step(model)
        print(f"  one decode step: {ops} ATen ops, {casts} dtype casts (_to_copy)")
        thread_comparison(model, max(4, args.frames // 2), args.prompt_rows, "as the machine is")
        if not args.no_busy:
            spinner = busy_core(args.busy_seconds)
            try:
                time.sleep(0.2)
                thread_comparison(model, max(4, args.frames // 2), args.prompt_rows, "one core busy     ")
            finally:
                spinner.kill()
                spinner.wait()
        threads = decode_threads(model)
        with torch_threads(threads):
            static_comparison(model, args.frames, args.prompt_rows, args.static_batches, not args.no_compile)
            for batch in args.batches:
                prefill, per_step = run(model, batch, args.prompt_rows, args.frames)
                if batch == 1:
                    print(f"  prefill of {args.prompt_rows} rows: {prefill * 1e3:.0f} ms ({threads} thread(s) from here on)")
                floor = weights_read_per_step(model, batch) / bandwidth
                print(f"  batch {batch:>2}: {batch / per_step:7.1f} frames/s, {per_step * 1e3:6.1f} ms per step; "
                      f"bandwidth floor {floor * 1e3:6.1f} ms ({floor / per_step:5.1%} of the floor's speed; "
                      f"{(per_step - floor) * 1e3:.1f} ms above it)")
            if not args.no_codec:
                print(f"  time to first audio (10 frames + codec window): {time_to_first_audio(model, args.prompt_rows):.2f} s")


if __name__ == "__main__":
    main()

"""Host work of the compiled decode step outside its graphs, per step, measured on this machine.

    PYTHONPATH=src python benchmarks/step_host_work.py                  # 40 layers, batches 1 and 8
    PYTHONPATH=src python benchmarks/step_host_work.py --layers 8 --batches 1 --frames 24

Two loops over the same compiled step, at the published depth (`--layers`, default 40) and the
tiny width of `benchmarks/gpu.py --dry-run`, on the CPU:

  in order  `DecodeRun.steps()`, the text stream's loop: `draw` and `feed` as two graphs, each draw
            read on the host before its row is fed;
  ahead     `DecodeRun.steps_ahead()`, `generate()`'s loop: one graph per step (`decoding.step.
            step`: draw, then feed).

The graphs run through `aot_eager` (no code generation) behind a timer, so a step's time splits into
the time inside its graphs and the host work around them: dynamo's guards and frames (which gather
the graphs' ~1,000 inputs on every call), the loop, the copies out of graph memory, the step's copy
to the host. On a GPU the graphs' time is device time; the host work is what each step costs the
host (less on a faster host), the floor of a step when it is queued ahead. Prints, per batch size,
ms per step inside and outside the graphs for each loop, and outside ms ahead / in order. Eos is
masked out, so every run makes `--frames` frames; each loop is warmed by one whole run first, then
timed `--repeats` times, the two loops taking turns; each row is the run with the least host work
(the least disturbed by the machine's other work).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import CompileConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402  (the published config, the meta-device build, the eos mask, the prefilled run)

from transformers_drama3.decoding.loop import DecodeRun  # noqa: E402
from transformers_drama3.kernels.torch_compat import raise_recompile_limit  # noqa: E402

LOOPS = {"in order": DecodeRun.steps, "ahead": DecodeRun.steps_ahead}


class GraphTimer:
    """A `torch.compile` backend: `aot_eager`, with the time spent inside its graphs added up."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, graph_module, example_inputs):
        compiled = torch._dynamo.lookup_backend("aot_eager")(graph_module, example_inputs)

        def timed(*args):
            started = time.perf_counter()
            try:
                return compiled(*args)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=gpu.PUBLISHED_LAYERS, help="backbone layers (default 40)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    parser.add_argument("--frames", type=int, default=48, help="frames per run (default 48)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per loop and batch size (default 3)")
    arguments = parser.parse_args(argv)
    if not gpu.MIN_LAYERS <= arguments.layers <= gpu.PUBLISHED_LAYERS:
        parser.error(f"--layers {arguments.layers}: expected {gpu.MIN_LAYERS} to {gpu.PUBLISHED_LAYERS}")
    if any(batch < 1 for batch in arguments.batches):
        parser.error(f"--batches {' '.join(map(str, arguments.batches))}: expected positive batch sizes")
    if arguments.frames < 2:
        parser.error(f"--frames {arguments.frames}: expected at least 2")
    if arguments.repeats < 1:
        parser.error(f"--repeats {arguments.repeats}: expected at least 1")
    return arguments


def timed_run(model, batch: int, frames: int, loop, compile_config: CompileConfig, timer: GraphTimer) -> tuple[float, float]:
    """(seconds per step, of which inside the graphs) of one run of `frames` frames through
    `loop`; the prefill is not timed."""
    run = gpu.prefilled_run(model, batch, 16, frames, "cpu", compile_config)
    timer.seconds, steps = 0.0, 0
    started = time.perf_counter()
    for _ in loop(run):
        steps += 1
    return (time.perf_counter() - started) / steps, timer.seconds / steps


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    torch.set_num_threads(1)
    model = gpu.without_eos(gpu.materialised(gpu.published_config(arguments.layers, dry_run=True), "cpu", torch.float32))
    timer = GraphTimer()
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=timer, mode=None)
    raise_recompile_limit(4 * len(arguments.batches))
    print(f"{arguments.layers} backbone layers, tiny width, CPU, {arguments.frames} frames per run, aot_eager graphs, "
          f"best of {arguments.repeats}")
    print("| batch | loop | ms/step | in graphs ms | outside ms |\n|---|---|---|---|---|")
    with torch.no_grad():
        for batch in arguments.batches:
            for loop in LOOPS.values():
                timed_run(model, batch, arguments.frames, loop, compile_config, timer)  # warm-up: the compile
            runs = {name: [] for name in LOOPS}
            for _ in range(arguments.repeats):
                for name, loop in LOOPS.items():
                    runs[name].append(timed_run(model, batch, arguments.frames, loop, compile_config, timer))
            outside = {}
            for name, timed in runs.items():
                per_step, inside = min(timed, key=lambda run: run[0] - run[1])
                outside[name] = per_step - inside
                print(f"| {batch} | {name} | {per_step * 1e3:.2f} | {inside * 1e3:.2f} | {outside[name] * 1e3:.2f} |",
                      flush=True)
            print(f"  batch {batch}: host work outside the graphs, ahead / in order = "
                  f"{outside['ahead'] / outside['in order']:.2f}", flush=True)


if __name__ == "__main__":
    main()

"""Compiles of the decode step as the batch size changes: fixed shapes against torch's automatic
dynamic shapes (the default compile config's), measured on this machine.

    PYTHONPATH=src python benchmarks/compile_count.py                       # inductor, batches 1 2 3 5
    PYTHONPATH=src python benchmarks/compile_count.py --backend aot_eager   # the traces alone: seconds

For each setting of `CompileConfig(dynamic=...)`:

  fixed      `dynamic=False`: every batch size (and length class) is a graph of its own shapes;
  automatic  `dynamic=None` (`decoding.loop.default_compile_config`): the first batch size
             compiles a graph of its shapes, the first one that differs a graph with the batch
             size symbolic, which every later batch size runs (batch 1 keeps its own).

a fresh process with an empty inductor cache decodes one run of `--frames` frames per batch size
(`--batches`, in that order) through `generate()`'s loop (`DecodeRun.steps_ahead()`), at the tiny
width of `benchmarks/gpu.py --dry-run` with `--layers` backbone layers, on the CPU, one thread.
Prints per batch size the seconds of its run (the compile included) and the step's graphs so far,
then per setting the total, and automatic / fixed. A graph's compile on a GPU (Triton code, CUDA
graphs) takes other times than here; the number of graphs is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {"fixed": False, "automatic": None}


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="backbone layers (default 4)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3, 5], help="batch sizes, in this order "
                                                                                   "(default 1 2 3 5)")
    parser.add_argument("--frames", type=int, default=4, help="frames per run (default 4)")
    parser.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"),
                        help="torch.compile backend (default inductor)")
    parser.add_argument("--setting", choices=tuple(SETTINGS), help=argparse.SUPPRESS)  # one setting, in this process
    arguments = parser.parse_args(argv)
    if not 4 <= arguments.layers <= 40:
        parser.error(f"--layers {arguments.layers}: expected 4 to 40 (a full-attention layer is every 4th)")
    if any(batch < 1 for batch in arguments.batches):
        parser.error(f"--batches {' '.join(map(str, arguments.batches))}: expected positive batch sizes")
    if arguments.frames < 1:
        parser.error(f"--frames {arguments.frames}: expected at least 1")
    return arguments


def run_setting(arguments) -> list[dict]:
    """In this process: one run per batch size with the setting's compile config; a row each."""
    import torch
    from transformers import CompileConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu  # the published config at a tiny width, the meta-device build, the eos mask, the prefilled run

    from transformers_drama3.decoding.loop import compiled_functions
    from transformers_drama3.decoding.steady_guards import graphs_of
    from transformers_drama3.kernels.torch_compat import raise_recompile_limit

    torch.set_num_threads(1)
    model = gpu.without_eos(gpu.materialised(gpu.published_config(arguments.layers, dry_run=True), "cpu", torch.float32))
    config = CompileConfig(fullgraph=True, dynamic=SETTINGS[arguments.setting], backend=arguments.backend, mode=None)
    raise_recompile_limit(2 * len(arguments.batches))
    rows = []
    with torch.no_grad():
        for batch in arguments.batches:
            started = time.perf_counter()
            for _ in gpu.prefilled_run(model, batch, 16, arguments.frames, "cpu", config).steps_ahead():
                pass
            rows.append({"batch": batch, "seconds": time.perf_counter() - started,
                         "graphs": graphs_of(compiled_functions(config).step)})
    return rows


def measured(arguments, setting: str) -> list[dict]:
    """The rows of `setting`, measured in a fresh process with an empty inductor cache."""
    command = [sys.executable, __file__, "--setting", setting, "--layers", str(arguments.layers), "--frames",
               str(arguments.frames), "--backend", arguments.backend, "--batches", *map(str, arguments.batches)]
    with tempfile.TemporaryDirectory() as cache:
        environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        finished = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        raise SystemExit(f"compile_count.py --setting {setting} failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    if arguments.setting is not None:
        print(json.dumps(run_setting(arguments)))
        return
    print(f"{arguments.layers} backbone layers, tiny width, CPU, {arguments.backend}, {arguments.frames} frames per "
          f"run, batch sizes {' '.join(map(str, arguments.batches))} in turn; a fresh process per setting")
    print("| setting | batch | seconds (compile included) | graphs so far |\n|---|---|---|---|")
    totals = {}
    for setting in SETTINGS:
        rows = measured(arguments, setting)
        for row in rows:
            print(f"| {setting} | {row['batch']} | {row['seconds']:.1f} | {row['graphs']} |", flush=True)
        totals[setting] = (sum(row["seconds"] for row in rows), rows[-1]["graphs"])
    for setting, (seconds, graphs) in totals.items():
        print(f"  {setting}: {seconds:.1f} s, {graphs} graphs")
    print(f"  automatic / fixed: {totals['automatic'][0] / totals['fixed'][0]:.2f} of the time, "
          f"{totals['automatic'][1]} / {totals['fixed'][1]} graphs")


if __name__ == "__main__":
    main()

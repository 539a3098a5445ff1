"""The device check's full-depth parts and their time limits, derived from its smoke part.

    python3 benchmarks/device_budget.py --smoke OUT/smoke.json --smoke-wall 95 --left 430 [--dry-run]

`benchmarks/device_check.sh` runs a smoke part first: `gpu.py` at `SMOKE_LAYERS` backbone layers of
the published width, FP8 experts, batch 1, compiled then eager. Its JSON says how long this machine
takes to start a benchmark process, build the model, compile the step (with inductor, CUDA-graph
capture and Triton's autotuning) and run it. This script scales those seconds to the published
depth (`FULL_LAYERS`) and prints the parts that fit the seconds left, most wanted first, as lines
the check script runs (`part NAME ESTIMATE LIMIT COMMAND...`, shell-quoted). Starting does not
grow with the layers; building grows with them (the routed experts are most of the weights);
compiling and running grow with the ops of a step (`step_ops`), most of which the tower, the
sampler and the embeddings make whatever the depth: a step of 40 layers calls 2.5 times the ATen
ops of one of 4, and its compile took 2.7 times as long (38.4 against 14.4 s of CPU, `gpu.py
--dry-run`, aot_eager, on this project's CPU).

  1. gpu.py, FP8 experts (the published format): batch 1, then 32 (the issue's two targets),
     then 8 and 64, as many as fit beside the CUDA tests' estimate; compiled, then eager
     (compiled: batch 1 compiles a graph, the second batch size one with the batch symbolic,
     which the later ones run). When not even batch 1 compiles in time at 40 layers: the 40
     layers eagerly, and batch 1 compiled at the most layers whose compile fits;
  2. the CUDA tests (every test marked gpu or skipped without CUDA): each compiles tiny 4-layer
     models, the smoke's depth, so each test that compiles is estimated at the smoke's compile;
  3. serve_load.py --realtime on the published model (eager engine);
  4. gpu.py, bf16 experts (60 GiB of them: an 80 GB card holds few batch sizes).

A part's ESTIMATE is what it needs at the least (the check skips a part when fewer seconds are
left); its LIMIT is `SAFETY` times that, or what is left. A part that does not fit is printed as
`skip NAME ESTIMATE "why"`. With --dry-run the same plan is made for `gpu.py --dry-run` on the CPU
(the full depth stands in at `DRY_RUN_FULL_LAYERS`, eager only; serve_load's tiny random model).
"""

from __future__ import annotations

import argparse
import ast
import json
import shlex
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SMOKE_LAYERS = 4
FULL_LAYERS = 40
STEP_OPS_FIXED = 3338
STEP_OPS_PER_LAYER = 163.5
"""The ATen ops of one decode step at L backbone layers: 3,338 + 163.5 L (the dry run's profiled
step, bf16 experts: 3,992 at 4 layers, 9,878 at 40)."""
DRY_RUN_FULL_LAYERS = 8
SAFETY = 1.5
"""A part's time limit over its estimate: the estimate scales a 4-layer measurement tenfold."""
FP8_BATCHES = (1, 32, 8, 64)
BF16_BATCHES = (1, 8)
FRAMES = 40
SERVE_SECONDS = 20
"""serve_load.py's --time-limit: each level of concurrent streams runs at most this long."""
SERVE_LEVELS = 6
"""1, 2, 4 ... 32 streams: the levels serve_load.py --realtime --clients 32 runs."""
TESTS = Path(__file__).resolve().parents[1] / "tests"


@dataclass(frozen=True)
class Smoke:
    """What the smoke part measured (its gpu.py JSON and the part's wall time)."""

    startup_s: float
    """The part's wall time less gpu.py's own seconds: starting Python, importing torch and the package."""
    build_s: float
    compile_s: float
    """The compiled row's compile, capture and autotuning."""
    compiled_run_s: float
    """One compiled run of the smoke's frames, warm: its warm-up less its compile."""
    eager_run_s: float
    """One eager run, its first (its warm-up: Triton's autotuning of the eager kernels included)."""
    layers: int
    frames: int

    @classmethod
    def read(cls, path: str, wall_s: float) -> Smoke:
        numbers = json.loads(Path(path).read_text())
        rows = {row["mode"]: row for row in numbers["rows"]}
        missing = {"compiled", "eager"} - rows.keys()
        if missing:
            raise SystemExit(f"{path}: the smoke part has no {', '.join(sorted(missing))} row")
        compiled, eager = rows["compiled"], rows["eager"]
        return cls(
            startup_s=max(0.0, wall_s - numbers["seconds"]), build_s=numbers["build_s"], compile_s=compiled["compile_s"],
            compiled_run_s=max(0.0, compiled["warm_up_s"] - compiled["compile_s"]), eager_run_s=eager["warm_up_s"],
            layers=numbers["layers"], frames=numbers["frames"],
        )


@dataclass(frozen=True)
class Part:
    name: str
    estimate_s: float
    command: list[str]

    def limit(self, left: float) -> int:
        return int(min(left, SAFETY * self.estimate_s) + 0.5)

    def line(self, left: float) -> str:
        return " ".join(["part", shlex.quote(self.name), str(int(self.estimate_s + 0.5)), str(self.limit(left)),
                         *map(shlex.quote, self.command)])


def step_ops(layers: int) -> float:
    return STEP_OPS_FIXED + STEP_OPS_PER_LAYER * layers


def gpu_seconds(smoke: Smoke, layers: int, batches: list[int], modes: list[str], frames: int) -> float:
    """Seconds a gpu.py process of `layers` layers needs for `batches` x `modes`: start, build,
    and per batch and mode three runs (warm-up, timed, profiled), a compiled mode compiling at its
    first two batch sizes. The build scales with the layers, compiles and runs with the step's
    ops, runs with the frames too."""
    scale = step_ops(layers) / step_ops(smoke.layers)
    runs = frames / smoke.frames
    seconds = smoke.startup_s + layers / smoke.layers * smoke.build_s
    for index, _ in enumerate(batches):
        if "compiled" in modes:
            seconds += scale * (smoke.compile_s * (index < 2) + 3 * runs * smoke.compiled_run_s)
        if "eager" in modes:
            seconds += scale * 3 * runs * smoke.eager_run_s
    return seconds


def gpu_command(experts: str, layers: int, batches: list[int], modes: list[str], frames: int, out: str,
                dry_run: bool) -> list[str]:
    suffix = "" if modes == ["compiled", "eager"] or dry_run else f"_{modes[0]}"
    command = ["python3", "benchmarks/gpu.py", "--experts", experts, "--layers", str(layers), "--batches",
               *map(str, batches), "--modes", *modes, "--frames", str(frames),
               "--json", f"{out}/gpu_{experts}{suffix}.json"]
    return command + (["--dry-run", "--prompt-rows", "8"] if dry_run else [])


def batches_part(smoke: Smoke, experts: str, layers: int, batches: tuple[int, ...], modes: list[str],
                 seconds: float, out: str, dry_run: bool) -> Part | None:
    """gpu.py of `experts` at `layers` layers in `modes` for the most batch sizes of `batches` (a
    prefix) that fit `seconds`; None when not even the first does."""
    frames = 12 if dry_run else FRAMES
    label = "" if modes == ["compiled", "eager"] or dry_run else f" {modes[0]}"
    for count in range(len(batches), 0, -1):
        chosen = list(batches[:count])
        estimate = gpu_seconds(smoke, layers, chosen, modes, frames)
        if estimate <= seconds:
            return Part(f"gpu.py {experts}{label} ({layers} layers)", estimate,
                        gpu_command(experts, layers, chosen, modes, frames, out, dry_run))
    return None


def gpu_parts(smoke: Smoke, experts: str, batches: tuple[int, ...], seconds: float, out: str, dry_run: bool) -> list[Part]:
    """gpu.py parts of `experts` that fit `seconds`: at the published depth compiled and eager for
    the most batch sizes; when not even batch 1 compiles in time there, the full depth eagerly (no
    compile: a few runs) in at most 40% of the time, then batch 1 compiled at the most layers (a
    multiple of 4, more than the smoke's) whose compile fits the rest. The dry run: eager only."""
    if dry_run:
        part = batches_part(smoke, experts, DRY_RUN_FULL_LAYERS, batches, ["eager"], seconds, out, dry_run)
        return [part] if part else []
    whole = batches_part(smoke, experts, FULL_LAYERS, batches, ["compiled", "eager"], seconds, out, dry_run)
    if whole is not None:
        return [whole]
    for share in (0.4, 1.0):
        eager = batches_part(smoke, experts, FULL_LAYERS, batches, ["eager"], share * seconds, out, dry_run)
        rest = seconds - (eager.estimate_s if eager is not None else 0)
        compiled = next((part for layers in range(FULL_LAYERS - 4, smoke.layers, -4)
                         if (part := batches_part(smoke, experts, layers, batches[:1], ["compiled"], rest, out, dry_run))),
                        None)
        if compiled is not None or share == 1.0:
            return [part for part in (eager, compiled) if part is not None]
    return []


def cuda_test_files() -> list[Path]:
    return sorted(path for path in TESTS.glob("test_*.py") if "cuda.is_available" in path.read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def compiling_cuda_tests(files: tuple[Path, ...]) -> int:
    """CUDA tests (marked gpu, or skipped without CUDA) whose body compiles or captures something."""
    count = 0
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")):
                continue
            first = min([decorator.lineno for decorator in node.decorator_list] + [node.lineno])
            decorators = "\n".join(lines[first - 1 : node.lineno - 1])
            body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            if ("mark.gpu" in decorators or "cuda" in decorators.lower()) and any(
                    word in body for word in ("compile", "static", "capture", "CUDAGraph")):
                count += 1
    return count


def cuda_tests_part(smoke: Smoke, dry_run: bool = False) -> Part:
    """The CUDA tests: pytest's start, a few seconds per test file, and each test that compiles
    one 4-layer compile (the smoke's). On a CPU (the dry run) every one of them is skipped."""
    files = cuda_test_files()
    compiles = 0 if dry_run else compiling_cuda_tests(tuple(files))
    estimate = smoke.startup_s + 2 * len(files) + compiles * smoke.compile_s
    command = ["python3", "-m", "pytest", "-q", "-rs", "-m", "not slow", "-p", "cuda_tests_only", "--maxfail", "10",
               *(str(path.relative_to(TESTS.parent)) for path in files)]
    return Part("CUDA tests", estimate, command)


def serve_part(smoke: Smoke, dry_run: bool) -> Part:
    """serve_load.py --realtime: start, build at the full depth, then each level of streams."""
    if dry_run:
        command = ["python3", "benchmarks/serve_load.py", "--random-model", "tiny", "--layers", "4", "--device", "cpu",
                   "--realtime", "--clients", "2", "--max-batch", "2", "--frames", "8", "--time-limit", "5"]
        # two levels of at most 5 s, the server's start and its warm-up: a start's worth more
        return Part("serve_load.py realtime", 2 * smoke.startup_s + smoke.build_s + 2 * 5, command)
    command = ["python3", "benchmarks/serve_load.py", "--random-model", "published", "--layers", str(FULL_LAYERS),
               "--device", "cuda", "--realtime", "--clients", "32", "--max-batch", "32", "--frames", "32",
               "--time-limit", str(SERVE_SECONDS)]
    estimate = smoke.startup_s + FULL_LAYERS / smoke.layers * smoke.build_s + SERVE_LEVELS * SERVE_SECONDS / 2
    return Part("serve_load.py realtime", estimate, command)


def plan_parts(smoke: Smoke, left: float, out: str, dry_run: bool = False) -> tuple[list[Part], list[tuple[str, str]]]:
    """(the parts to run in order, each within `left` seconds taken in turn; the parts left out and why)."""
    parts, skipped = [], []

    def take(name: str, chosen: list[Part]) -> bool:
        nonlocal left
        chosen = [part for part in chosen if part.estimate_s <= left]
        for part in chosen:
            parts.append(part)
            left -= part.estimate_s
        return bool(chosen)

    cuda = cuda_tests_part(smoke, dry_run)
    # the FP8 benchmark first when it fits beside the CUDA tests, else whatever of it fits after them
    fp8_first = take("gpu.py fp8", gpu_parts(smoke, "fp8", FP8_BATCHES, left - cuda.estimate_s, out, dry_run))
    if not take("CUDA tests", [cuda]):
        skipped.append(("CUDA tests", "not enough time left for its estimate"))
    if not fp8_first and not take("gpu.py fp8", gpu_parts(smoke, "fp8", FP8_BATCHES, left, out, dry_run)):
        skipped.append(("gpu.py fp8", "not enough time left for its estimate"))
    if not take("serve_load.py realtime", [serve_part(smoke, dry_run)]):
        skipped.append(("serve_load.py realtime", "not enough time left for its estimate"))
    if not take("gpu.py bf16", gpu_parts(smoke, "bf16", BF16_BATCHES, left, out, dry_run)):
        skipped.append(("gpu.py bf16", "not enough time left for its estimate"))
    return parts, skipped


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", required=True, help="the smoke part's gpu.py JSON")
    parser.add_argument("--smoke-wall", type=float, required=True, help="the smoke part's wall seconds")
    parser.add_argument("--left", type=float, required=True, help="seconds left for the full-depth parts")
    parser.add_argument("--out", default="device-check", help="where the parts write their JSON")
    parser.add_argument("--dry-run", action="store_true", help="plan the CPU dry run of the check")
    arguments = parser.parse_args(argv)
    smoke = Smoke.read(arguments.smoke, arguments.smoke_wall)
    parts, skipped = plan_parts(smoke, arguments.left, arguments.out, arguments.dry_run)
    print(f"# smoke at {smoke.layers} layers: start {smoke.startup_s:.0f} s, build {smoke.build_s:.0f} s, compile "
          f"{smoke.compile_s:.0f} s, a compiled run {smoke.compiled_run_s:.1f} s, an eager run {smoke.eager_run_s:.1f} s; "
          f"{arguments.left:.0f} s left")
    left = arguments.left
    for part in parts:
        print(part.line(left))
        left -= part.estimate_s
    for name, why in skipped:
        print(f"skip {shlex.quote(name)} {shlex.quote(why)}")


if __name__ == "__main__":
    main()

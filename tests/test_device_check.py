"""benchmarks/device_check.sh and its plan (benchmarks/device_budget.py): the versions first, a smoke
part whose failure stops the check, then the full-depth parts with time limits scaled from what the
smoke part measured, inside the check's seconds; run on a CPU with --dry-run (gpu.py's tiny width)."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest

from script_helpers import BENCHMARKS, loaded_script

CHECK = BENCHMARKS / "device_check.sh"
ROOT = BENCHMARKS.parent


@pytest.fixture(scope="module")
def budget():
    with loaded_script(BENCHMARKS / "device_budget.py", "device_budget") as module:
        yield module


def smoke(budget, **changes):
    """A smoke part's measurements at 4 layers (seconds), as a GPU machine might report them."""
    values = dict(startup_s=20.0, build_s=2.0, compile_s=30.0, compiled_run_s=1.0, eager_run_s=1.5, layers=4, frames=12)
    return budget.Smoke(**{**values, **changes})


def names(parts) -> list[str]:
    return [part.name for part in parts]


def option(command: list[str], flag: str) -> list[str]:
    """The values after `flag` in a command, up to the next flag."""
    values = command[command.index(flag) + 1:]
    return values[: next((i for i, value in enumerate(values) if value.startswith("--")), len(values))]


def test_a_gpu_part_is_the_smokes_seconds_scaled_to_its_layers_and_frames(budget):
    """Start once; the build ten times the 4-layer smoke's at 40 layers; compiles (at the first two
    batch sizes: batch 1's graph, the symbolic one) and three runs per batch and mode (warm-up,
    timed, profiled) as the step's ops, 9,878 against 3,992; runs in proportion to the frames."""
    measured = smoke(budget)
    ops = 9878 / 3992
    assert budget.step_ops(40) / budget.step_ops(4) == pytest.approx(ops)
    runs = 3 * 40 / 12
    per_batch_compiled = [ops * (30 + runs * 1.0), ops * (30 + runs * 1.0), ops * runs * 1.0]
    eager = ops * runs * 1.5
    expected = 20 + 10 * 2 + sum(compiled + eager for compiled in per_batch_compiled)
    assert budget.gpu_seconds(measured, 40, [1, 32, 8], ["compiled", "eager"], 40) == pytest.approx(expected)
    eight = budget.step_ops(8) / budget.step_ops(4)
    assert budget.gpu_seconds(measured, 8, [1], ["eager"], 40) == pytest.approx(20 + 2 * 2 + eight * runs * 1.5)


def test_with_time_for_everything_every_part_runs_most_wanted_first(budget):
    parts, skipped = budget.plan_parts(smoke(budget), 100_000, "out")
    assert names(parts) == ["gpu.py fp8 (40 layers)", "CUDA tests", "serve_load.py realtime", "gpu.py bf16 (40 layers)"]
    assert skipped == []
    fp8, cuda, serve, bf16 = parts
    assert option(fp8.command, "--batches") == ["1", "32", "8", "64"] and option(fp8.command, "--modes") == ["compiled", "eager"]
    assert option(fp8.command, "--layers") == ["40"] and option(fp8.command, "--json") == ["out/gpu_fp8.json"]
    assert option(bf16.command, "--batches") == ["1", "8"] and "--dry-run" not in fp8.command
    assert "cuda_tests_only" in cuda.command and "--random-model" in serve.command
    # each part's limit is 1.5 times its estimate, or what is left
    assert fp8.limit(100_000) == round(1.5 * fp8.estimate_s) and fp8.limit(60) == 60
    assert fp8.line(100_000).startswith(f"part 'gpu.py fp8 (40 layers)' {round(fp8.estimate_s)} {fp8.limit(100_000)} python3 ")


def test_the_fp8_batches_shrink_to_what_fits_beside_the_cuda_tests(budget):
    measured = smoke(budget)
    cuda = budget.cuda_tests_part(measured).estimate_s
    two = budget.gpu_seconds(measured, 40, [1, 32], ["compiled", "eager"], 40)
    three = budget.gpu_seconds(measured, 40, [1, 32, 8], ["compiled", "eager"], 40)
    parts, _ = budget.plan_parts(measured, cuda + (two + three) / 2, "out")
    assert names(parts)[:2] == ["gpu.py fp8 (40 layers)", "CUDA tests"]
    assert option(parts[0].command, "--batches") == ["1", "32"]
    assert sum(part.estimate_s for part in parts) <= cuda + (two + three) / 2


def test_when_batch_1_cannot_compile_at_40_layers_the_full_depth_runs_eagerly_and_fewer_layers_compile(budget):
    """A compile of 300 s at 4 layers is 740 s at 40: then 40 layers eagerly, and batch 1
    compiled at the most layers that fit the rest."""
    measured = smoke(budget, compile_s=300.0)
    cuda = budget.cuda_tests_part(measured).estimate_s
    parts, _ = budget.plan_parts(measured, cuda + 600, "out")
    eager, compiled = parts[:2]
    assert eager.name == "gpu.py fp8 eager (40 layers)" and option(eager.command, "--modes") == ["eager"]
    assert compiled.name.startswith("gpu.py fp8 compiled (") and option(compiled.command, "--batches") == ["1"]
    layers = int(option(compiled.command, "--layers")[0])
    rest = 600 - eager.estimate_s
    assert budget.gpu_seconds(measured, layers, [1], ["compiled"], 40) <= rest
    assert budget.gpu_seconds(measured, layers + 4, [1], ["compiled"], 40) > rest
    assert option(eager.command, "--json") != option(compiled.command, "--json")  # neither overwrites the other


def test_parts_without_the_time_for_their_estimate_are_skipped_by_name(budget):
    parts, skipped = budget.plan_parts(smoke(budget), 5, "out")
    assert parts == []
    assert [name for name, _ in skipped] == ["CUDA tests", "gpu.py fp8", "serve_load.py realtime", "gpu.py bf16"]


def test_the_plan_prints_lines_the_check_runs(budget, tmp_path, capsys):
    numbers = {"seconds": 50.0, "build_s": 3.0, "layers": 4, "frames": 12, "rows": [
        {"mode": "compiled", "warm_up_s": 31.0, "compile_s": 30.0}, {"mode": "eager", "warm_up_s": 1.5, "compile_s": 0.0}]}
    path = tmp_path / "smoke.json"
    path.write_text(json.dumps(numbers))
    budget.main(["--smoke", str(path), "--smoke-wall", "70", "--left", "100000", "--out", "out"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# smoke at 4 layers: start 20 s, build 3 s, compile 30 s")
    measured = budget.Smoke.read(str(path), 70)
    assert measured == smoke(budget, build_s=3.0)
    parts, _ = budget.plan_parts(measured, 100_000, "out")
    left = 100_000
    for line, part in zip(lines[1:], parts):
        assert line == part.line(left)
        words = shlex.split(line)
        assert words[:4] == ["part", part.name, str(round(part.estimate_s)), str(part.limit(left))] and words[4:] == part.command
        left -= part.estimate_s
    numbers["rows"] = numbers["rows"][1:]
    path.write_text(json.dumps(numbers))
    with pytest.raises(SystemExit, match="no compiled row"):
        budget.Smoke.read(str(path), 70)


def fake_python(tmp_path, failing: str):
    """A `python3` first on PATH that fails running `failing` and runs everything else."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "python3"
    script.write_text(f'#!/bin/sh\nif [ "$1" = "{failing}" ]; then echo "planted failure" >&2; exit 3; fi\n'
                      f'exec {shlex.quote(sys.executable)} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def run_check(tmp_path, *arguments, path=None, timeout=900):
    out = tmp_path / "out"
    environment = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT / "src")}
    if path is not None:
        environment["PATH"] = path
    done = subprocess.run(["bash", str(CHECK), *arguments], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=timeout)
    return done, out, (out / "log.txt").read_text()


def test_a_failing_smoke_part_stops_the_check_after_the_versions(tmp_path):
    done, out, log = run_check(tmp_path, "--dry-run", path=fake_python(tmp_path, "benchmarks/gpu.py"))
    assert done.returncode == 1
    lines = log.splitlines()
    first_part = next(index for index, line in enumerate(lines) if line.startswith("=== "))
    assert re.match(r"python \d+\.\d+\.\d+ \| torch \S+ \| cuda ", lines[0])
    assert any(line.startswith(("triton ", "triton:")) for line in lines[:first_part])
    assert lines[first_part].startswith("=== smoke: gpu.py fp8 (4 layers)")
    assert "=== smoke: gpu.py fp8 (4 layers): exit 3" in log and "planted failure" in log
    assert "the smoke part failed: the full-depth parts are not run" in log
    assert not (out / "plan.txt").exists() and "=== CUDA tests" not in log and "=== summary" in log


def test_bad_arguments_are_refused(tmp_path):
    done = subprocess.run(["bash", str(CHECK), "--fast"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2 and "usage:" in done.stderr


@pytest.mark.slow
def test_a_dry_run_runs_the_smoke_part_then_the_planned_parts_in_order_within_its_seconds(tmp_path, budget):
    """The whole check on the CPU: versions, the smoke part (4 layers, compiled and eager, its
    step's ops listed), the plan made from its JSON, each planned part started in order with its
    rows in OUT, and the summary, inside the check's 540 seconds."""
    done, out, log = run_check(tmp_path, "--dry-run")
    assert done.returncode == 0, log[-3000:]
    lines = log.splitlines()
    assert re.match(r"python \d+\.\d+\.\d+ \| torch ", lines[0])
    assert next(line for line in lines if line.startswith("=== ")).startswith("=== smoke: gpu.py fp8 (4 layers)")
    assert "fp8 compiled batch 1: compile, capture and autotuning" in log
    assert re.search(r"fp8 compiled batch 1: \d+ ATen ops in one step, \d+ distinct:", log)
    smoke_rows = json.loads((out / "smoke.json").read_text())["rows"]
    assert [row["mode"] for row in smoke_rows] == ["compiled", "eager"] and smoke_rows[0]["step_ops"]
    # the plan is device_budget's, made from the smoke part's JSON, its wall time and the seconds left
    wall = int(re.search(r"=== smoke: gpu\.py fp8 \(4 layers\): exit 0 after (\d+) s", log).group(1))
    left = float(re.search(r"; (\d+) s left$", (out / "plan.txt").read_text().splitlines()[0]).group(1))
    parts, skipped = budget.plan_parts(budget.Smoke.read(str(out / "smoke.json"), wall), left, str(out), dry_run=True)
    plan = (out / "plan.txt").read_text().splitlines()[1:]
    assert plan[: len(parts)] == [part.line(left - sum(p.estimate_s for p in parts[:i])) for i, part in enumerate(parts)]
    starts = [log.index(f"=== {part.name} ") for part in parts]
    assert starts == sorted(starts) and starts[0] > log.index("=== smoke")
    for part in parts:
        # a part may reach its limit on a busy CPU (124: the check's timeout doing its job, estimates are a
        # GPU's); nothing may fail
        assert re.search(rf"=== {re.escape(part.name)}: (exit (0|124) after \d+ s|skipped)", log), part.name
    for name, _ in skipped:
        assert f"=== {name}: skipped" in log
    fp8 = next(part for part in parts if part.name.startswith("gpu.py fp8"))
    if re.search(rf"=== {re.escape(fp8.name)}: exit 0 after", log):  # its rows are whole
        rows = json.loads((out / "gpu_fp8.json").read_text())["rows"]
        assert [str(row["batch"]) for row in rows] == option(fp8.command, "--batches")
    summary = int(re.search(r"=== summary \((\d+) s of 540\)", log).group(1))
    assert summary <= 540

"""benchmarks/step_host_work.py: the compiled step's host work outside its graphs, per loop
(`DecodeRun.steps()` against `steps_ahead()`): its graph timer, its arguments, and a short run whose
table adds up."""

import re

import pytest
import torch

from script_helpers import BENCHMARKS, loaded_script

SCRIPT = BENCHMARKS / "step_host_work.py"


@pytest.fixture(scope="module")
def host_work():
    with loaded_script(SCRIPT, "step_host_work") as module:
        yield module


def test_the_graph_timer_adds_up_the_time_inside_its_graphs_and_computes_what_eager_computes(host_work):
    timer = host_work.GraphTimer()
    compiled = torch.compile(lambda x: (x.sin() * 3).sum(dim=-1), backend=timer, fullgraph=True)
    x = torch.randn(64, 256)
    torch.testing.assert_close(compiled(x), (x.sin() * 3).sum(dim=-1))
    first = timer.seconds
    compiled(x)
    assert 0 < first < timer.seconds


@pytest.mark.parametrize("bad", [["--layers", "3"], ["--layers", "41"], ["--batches", "0"], ["--frames", "1"], ["--repeats", "0"]])
def test_bad_arguments_are_refused_naming_the_flag(host_work, bad, capsys):
    with pytest.raises(SystemExit):
        host_work.parse_arguments(bad)
    assert bad[0] in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_prints_both_loops_whose_times_add_up(host_work, capsys):
    torch._dynamo.reset()
    host_work.main(["--layers", "4", "--batches", "1", "--frames", "6", "--repeats", "2"])
    output = capsys.readouterr().out
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in output.splitlines()
            if line.startswith("| 1 |")]
    assert [row[1] for row in rows] == ["in order", "ahead"]
    outside = []
    for _, _, per_step, inside, out in rows:
        assert float(inside) > 0 and float(out) > 0
        assert float(per_step) == pytest.approx(float(inside) + float(out), abs=0.011)
        outside.append(float(out))
    ratio = float(re.search(r"ahead / in order = ([0-9.]+)", output).group(1))
    assert ratio == pytest.approx(outside[1] / outside[0], abs=0.01 + 0.01 * ratio)

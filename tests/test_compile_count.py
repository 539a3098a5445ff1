"""benchmarks/compile_count.py: graphs of the decode step over several batch sizes, fixed shapes
against torch's automatic dynamic shapes: its arguments, and a short run whose table adds up."""

import re

import pytest

from script_helpers import BENCHMARKS, loaded_script

SCRIPT = BENCHMARKS / "compile_count.py"


@pytest.fixture(scope="module")
def compile_count():
    with loaded_script(SCRIPT, "compile_count") as module:
        yield module


@pytest.mark.parametrize("bad", [["--layers", "3"], ["--layers", "41"], ["--batches", "0"], ["--frames", "0"],
                                 ["--backend", "eager"]])
def test_bad_arguments_are_refused_naming_the_flag(compile_count, bad, capsys):
    with pytest.raises(SystemExit):
        compile_count.parse_arguments(bad)
    assert bad[0] in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_counts_a_graph_per_batch_size_fixed_and_two_automatic(compile_count, capsys):
    compile_count.main(["--backend", "aot_eager", "--batches", "1", "2", "3", "--frames", "2"])
    output = capsys.readouterr().out
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in output.splitlines()
            if re.match(r"\| (fixed|automatic) \|", line)]
    graphs = {(setting, int(batch)): int(count) for setting, batch, _, count in rows}
    assert graphs == {("fixed", 1): 1, ("fixed", 2): 2, ("fixed", 3): 3,
                      ("automatic", 1): 1, ("automatic", 2): 2, ("automatic", 3): 2}
    seconds = {setting: sum(float(row[2]) for row in rows if row[0] == setting) for setting in ("fixed", "automatic")}
    total = float(re.search(r"automatic: ([0-9.]+) s, 2 graphs", output).group(1))
    assert total == pytest.approx(seconds["automatic"], abs=0.2)  # the rows' total, rounding aside
    ratio = float(re.search(r"automatic / fixed: ([0-9.]+) of the time, 2 / 3 graphs", output).group(1))
    assert ratio == pytest.approx(seconds["automatic"] / seconds["fixed"], abs=0.02)

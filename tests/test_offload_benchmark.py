"""benchmarks/offload.py parses its arguments and runs end to end at a tiny width (--dry-run)."""


import pytest

from script_helpers import BENCHMARKS, loaded_script

SCRIPT = BENCHMARKS / "offload.py"


@pytest.fixture(scope="module")
def offload_benchmark():
    with loaded_script(SCRIPT, "offload_benchmark") as module:
        yield module


@pytest.mark.parametrize("bad", [["--layers", "6"], ["--layers", "0"], ["--frames", "0"], ["--prompt-rows", "0"],
                                 ["--cache", "8", "0"], ["--width", "huge"]])
def test_bad_arguments_are_refused_naming_the_flag(offload_benchmark, bad, capsys):
    with pytest.raises(SystemExit):
        offload_benchmark.parse_arguments(bad)
    assert bad[0] in capsys.readouterr().err


def test_the_dry_run_prints_the_resident_and_each_cache(offload_benchmark, capsys):
    offload_benchmark.main(["--dry-run", "--cache", "1", "8"])

    out = capsys.readouterr().out
    assert "resident" in out
    assert "   1 cached/layer" in out and "   8 cached/layer" in out and "x resident" in out

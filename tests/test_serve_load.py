"""benchmarks/serve_load.py: when a stream ran faster than real time, the concurrent real-time
streams it reports, its arguments, and a run on a model of random weights built in memory (what it
serves on a GPU machine that holds no checkpoint), end to end on the CPU."""


import pytest
import torch

from script_helpers import BENCHMARKS, loaded_script

RATE = 100.0  # samples per second: 200 bytes of 16-bit PCM are one second of audio


@pytest.fixture(scope="module")
def serve_load():
    with loaded_script(BENCHMARKS / "serve_load.py", "serve_load_benchmark") as module:
        yield module


def stream(*chunks):
    """A stream's result: chunks as (seconds since the request, seconds of audio)."""
    return {"ttfa": chunks[0][0], "chunks": [(arrival, int(seconds * RATE * 2)) for arrival, seconds in chunks]}


def test_a_stream_whose_chunks_arrive_before_the_audio_runs_out_never_stalls(serve_load):
    # 1 s of audio at 0.5 s, the next second of audio at 1.4 s: the player still had 0.1 s left
    assert serve_load.playback_stall(stream((0.5, 1.0), (1.4, 1.0)), RATE) == pytest.approx(0.0)
    assert serve_load.realtime_streams([stream((0.5, 1.0), (1.4, 1.0))], RATE) == 1


def test_a_chunk_late_for_the_player_is_a_stall_of_its_lateness(serve_load):
    # 1 s of audio at 0.5 s, the next at 1.8 s: the player waited 0.3 s
    late = stream((0.5, 1.0), (1.8, 1.0))
    assert serve_load.playback_stall(late, RATE) == pytest.approx(0.3)
    assert serve_load.realtime_streams([late, stream((0.5, 2.0))], RATE) == 1


def test_a_failed_stream_is_never_real_time(serve_load):
    assert serve_load.playback_stall({"error": "status 500"}, RATE) == float("inf")
    assert serve_load.playback_stall({"ttfa": None, "chunks": []}, RATE) == float("inf")


def test_the_concurrent_real_time_streams_are_the_largest_level_all_of_whose_streams_kept_up(serve_load):
    fast, late = stream((0.1, 1.0), (0.9, 1.0)), stream((0.1, 1.0), (1.5, 1.0))
    levels = {1: [fast], 2: [fast, fast], 4: [fast, fast, fast, late]}
    assert serve_load.most_realtime_streams(levels, RATE) == 2
    assert serve_load.most_realtime_streams({1: [late]}, RATE) == 0
    assert serve_load.realtime_levels(32) == [1, 2, 4, 8, 16, 32]
    assert serve_load.realtime_levels(5) == [1, 2, 4, 5] and serve_load.realtime_levels(1) == [1]


@pytest.mark.parametrize("bad", [["--random-model", "published", "--model", "x"], ["--layers", "3"],
                                 ["--random-model", "tiny", "--adapters", "2"], ["--random-model", "huge"]])
def test_bad_arguments_are_refused_naming_the_flag(serve_load, bad, capsys):
    with pytest.raises(SystemExit):
        serve_load.parse_arguments(bad)
    assert bad[0] in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where there is no CUDA device")
def test_a_cuda_device_is_refused_where_there_is_none(serve_load, capsys):
    with pytest.raises(SystemExit):
        serve_load.parse_arguments(["--device", "cuda"])
    assert "--device cuda" in capsys.readouterr().err


def test_the_defaults_serve_the_bundled_model_on_the_cpu_eagerly(serve_load):
    arguments = serve_load.parse_arguments([])
    assert arguments.device == "cpu" and not arguments.compile and arguments.random_model is None
    assert not arguments.realtime and arguments.layers == 40


def test_a_random_model_serves_concurrent_streams_and_reports_how_many_ran_in_real_time(serve_load, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when the script runs: its neighbour gpu.py imports
    serve_load.main(["--random-model", "tiny", "--layers", "4", "--realtime", "--clients", "2", "--frames", "12",
                     "--max-batch", "2", "--time-limit", "60"])
    output = capsys.readouterr().out
    rows = [line for line in output.splitlines() if line.startswith("| ") and not line.startswith("| streams")]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2"]
    assert all(row.split("|")[2].strip() == "0" for row in rows)  # no errors
    assert "concurrent real-time streams: " in output

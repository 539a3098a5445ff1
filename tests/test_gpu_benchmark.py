"""benchmarks/gpu.py parses its arguments, extrapolates depth linearly, and runs end to end at a
tiny width on the CPU (--dry-run), so it is ready when a GPU is at hand."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu_benchmark():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_defaults_measure_bf16_and_fp8_eager_and_graph_at_batch_1_and_16(gpu_benchmark):
    arguments = gpu_benchmark.parse_arguments([])
    assert arguments.experts == ["bf16", "fp8"] and arguments.modes == ["eager", "graph"]
    assert arguments.batch == 16 and arguments.depths == [4, 8] and not arguments.dry_run


@pytest.mark.parametrize("bad", [["--depths", "8", "4"], ["--depths", "0", "4"], ["--depths", "2", "4"], ["--batch", "0"],
                                 ["--frames", "1"],
                                 ["--experts", "int4"]])
def test_bad_arguments_are_refused_naming_the_flag(gpu_benchmark, bad, capsys):
    with pytest.raises(SystemExit):
        gpu_benchmark.parse_arguments(bad)
    assert bad[0] in capsys.readouterr().err


def test_depth_is_extrapolated_along_the_line_through_the_two_measurements(gpu_benchmark):
    assert gpu_benchmark.extrapolate((4, 10.0), (8, 18.0), 40) == pytest.approx(82.0)


def test_the_published_config_keeps_the_published_width_at_fewer_layers(gpu_benchmark):
    from transformers_drama3 import Drama3Config

    config, published = gpu_benchmark.published_config(4, dry_run=False), Drama3Config()
    assert config.text_config.num_hidden_layers == 4
    assert config.text_config.layer_types == published.text_config.layer_types[:4]
    assert config.hidden_size == published.hidden_size and config.text_config.num_experts == published.text_config.num_experts


def test_fp8_stored_experts_compute_what_the_bf16_experts_do_within_fp8_error(gpu_benchmark):
    import torch

    model = gpu_benchmark.build(4, "cpu", torch.float32, dry_run=True)
    experts = model.backbone.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, model.config.hidden_size, generator=generator)
    index = torch.randint(0, experts.num_experts, (5, 2), generator=generator)
    weights = torch.rand(5, 2, generator=generator)
    with torch.no_grad():
        expected = experts(hidden, index, weights)
        stored = gpu_benchmark.Fp8StoredExperts(experts)(hidden, index, weights)
    # e4m3 keeps 3 mantissa bits: a relative error of ~6% per weight, averaged over each sum
    torch.testing.assert_close(stored, expected, rtol=0.1, atol=0.1 * float(expected.abs().max()))


def test_a_dry_run_prints_every_measurement_against_the_papers_figures(gpu_benchmark, capsys):
    gpu_benchmark.main(["--dry-run", "--depths", "4", "8", "--frames", "2", "--prompt-rows", "4", "--batch", "2",
                        "--modes", "eager", "static"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "frames/s" in line]
    assert len(lines) == 8  # bf16 and fp8, the eager loop and the static step, batch 1 and 2
    assert all("the paper's 271" in line and "S2's 177" in line and "first audio" in line for line in lines)


def test_the_graph_modes_capture_the_static_step_whole(gpu_benchmark):
    """graph: CUDA graphs without code generation (aot_eager traces the same graph on a CPU);
    compiled: inductor with CUDA graphs, what generate(cache_implementation="static") does on a GPU.
    (The compiled static step itself is tested in test_static_decode.py.)"""
    graph, compiled = gpu_benchmark.compile_config_of("graph", "cuda"), gpu_benchmark.compile_config_of("compiled", "cuda")
    assert graph.fullgraph and graph.backend == "cudagraphs"
    assert compiled.fullgraph and compiled.backend == "inductor" and compiled.mode == "reduce-overhead"
    assert gpu_benchmark.compile_config_of("graph", "cpu").backend == "aot_eager"
    assert gpu_benchmark.compile_config_of("compiled", "cpu").mode is None  # no CUDA graphs on a CPU
    assert gpu_benchmark.compile_config_of("eager", "cuda") is None and gpu_benchmark.compile_config_of("static", "cuda") is None

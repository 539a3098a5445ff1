"""benchmarks/gpu.py: its arguments, the model it builds (the full depth, from the meta device),
the weights a step reads, the CUDA-graph capture check, and a run end to end at a tiny width on the
CPU (--dry-run) whose table and numbers agree, so it is ready when a GPU is at hand."""

import json
import logging
import sys

import pytest
import torch

from script_helpers import BENCHMARKS, loaded_script

SCRIPT = BENCHMARKS / "gpu.py"
QUICK = ["--dry-run", "--frames", "12", "--prompt-rows", "8"]


@pytest.fixture(scope="module")
def gpu_benchmark():
    with loaded_script(SCRIPT, "gpu_benchmark") as module:
        yield module


def table(output: str) -> tuple[list[str], list[list[str]]]:
    """(header cells, data rows' cells) of the markdown table a run printed."""
    lines = [line for line in output.splitlines() if line.startswith("| ")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return cells[0], cells[1:]


def test_the_defaults_measure_the_published_depth_compiled_and_eager_at_batches_1_8_32_64(gpu_benchmark):
    arguments = gpu_benchmark.parse_arguments([])
    assert arguments.layers == 40 and arguments.batches == [1, 8, 32, 64]
    assert arguments.modes == ["compiled", "eager"] and arguments.experts == "bf16"
    assert arguments.prompt_rows == 256 and not arguments.dry_run
    dry_run = gpu_benchmark.parse_arguments(["--dry-run"])
    assert (dry_run.layers, dry_run.batches, dry_run.frames, dry_run.prompt_rows) == (4, [1, 2], 16, 16)
    assert gpu_benchmark.parse_arguments(["--dry-run", "--batches", "3", "--layers", "8"]).batches == [3]


@pytest.mark.parametrize("bad", [["--layers", "3"], ["--layers", "41"], ["--batches", "1", "0"], ["--frames", "11"],
                                 ["--prompt-rows", "0"], ["--experts", "int4"], ["--modes", "graph"]])
def test_bad_arguments_are_refused_naming_the_flag(gpu_benchmark, bad, capsys):
    with pytest.raises(SystemExit):
        gpu_benchmark.parse_arguments(bad)
    assert bad[0] in capsys.readouterr().err


def test_the_benchmarked_config_is_the_published_one_at_full_depth(gpu_benchmark):
    from transformers_drama3 import Drama3Config

    config, published = gpu_benchmark.published_config(40, dry_run=False), Drama3Config()
    assert config.to_dict() == published.to_dict()
    assert gpu_benchmark.published_config(8, dry_run=False).text_config.layer_types == published.text_config.layer_types[:8]


def test_the_model_materialised_from_the_meta_device_has_every_tensor_a_built_model_has(gpu_benchmark):
    from transformers_drama3 import Drama3ForSpeechGeneration

    config = gpu_benchmark.published_config(4, dry_run=True)
    model = gpu_benchmark.materialised(config, "cpu", torch.bfloat16)
    built = Drama3ForSpeechGeneration._from_config(config, dtype=torch.bfloat16)
    parameters, expected = dict(model.named_parameters()), dict(built.named_parameters())
    assert parameters.keys() == expected.keys()
    assert all(parameters[name].shape == expected[name].shape and parameters[name].dtype == expected[name].dtype
               for name in expected)
    assert all(parameter.device.type == "cpu" and parameter.isfinite().all() for parameter in parameters.values())
    # random, not left empty: the initialisation ran (weights of std 0.02, zero-centred norms)
    assert 0.01 < float(model.lm_head.weight.detach().float().std()) < 0.04
    for name, buffer in built.named_buffers():  # rotary tables computed as a built model's
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, rtol=0, atol=0)


def test_one_step_reads_the_papers_weights_per_frame_at_batch_1_and_more_experts_for_a_batch(gpu_benchmark):
    from transformers_drama3.placement.accounting import account
    from transformers_drama3.placement.planning import plan_memory

    config = gpu_benchmark.published_config(40, dry_run=False)
    accounting = account(config)
    fp8 = gpu_benchmark.weights_read_per_step(config, "fp8", 1)
    assert fp8 == accounting.weights_bytes_per_frame  # the paper's ~6.0 GB: FP8 experts, their scales
    assert round(fp8 / 1e9, 1) == 5.9
    # bf16 experts: 2 bytes per expert weight, no scales
    bf16 = gpu_benchmark.weights_read_per_step(config, "bf16", 1)
    assert bf16 - fp8 == accounting.routed_expert_parameters_per_frame - accounting.routed_expert_scales_per_frame * 4
    # a batch reaches more distinct experts, never more than every expert of every layer
    every = plan_memory(config, "fp8").routed_experts
    sizes = [gpu_benchmark.weights_read_per_step(config, "fp8", batch) for batch in (1, 8, 32, 64, 10_000)]
    assert sizes == sorted(sizes) and sizes[-1] == pytest.approx(fp8 - every * 8 / 256 + every, rel=1e-6)
    assert gpu_benchmark.distinct_experts(256, 8, 1) == pytest.approx(8)


def test_a_dry_run_prints_one_row_per_mode_and_batch_whose_numbers_agree(gpu_benchmark, tmp_path, capsys):
    path = tmp_path / "numbers.json"
    gpu_benchmark.main([*QUICK, "--modes", "eager", "--batches", "1", "2", "--json", str(path), "--list-kernels"])
    output = capsys.readouterr().out
    header, rows = table(output)
    assert header == ["experts", "mode", "batch", "ms/frame", "frames/s", "aten ops/step", "graphs/step", "GB/step",
                      "floor ms", "x floor", "TTFA ms", "+codec ms", "captured"]
    assert [(row[0], row[1], row[2]) for row in rows] == [("bf16", "eager", "1"), ("bf16", "eager", "2")]
    numbers = json.loads(path.read_text())
    bandwidth = numbers["copy_bandwidth_gb_per_s"] * 1e9
    config = gpu_benchmark.published_config(numbers["layers"], dry_run=True)
    for printed, row in zip(rows, numbers["rows"]):
        batch = row["batch"]
        assert row["frames_per_second"] == pytest.approx(batch * 1000 / row["ms_per_frame"])
        assert row["gb_per_step"] * 1e9 == pytest.approx(gpu_benchmark.weights_read_per_step(config, "bf16", batch))
        assert row["floor_ms"] == pytest.approx(row["gb_per_step"] * 1e9 / bandwidth * 1e3)
        assert row["times_floor"] == pytest.approx(row["ms_per_frame"] / row["floor_ms"])
        assert 0 < row["ttfa_ms"] <= row["ttfa_codec_ms"]
        assert row["ops_counted"] == "aten ops" and row["ops_per_step"] > 100 and row["graphs_per_step"] is None
        assert row["captured"] == "n/a (eager)" and row["failures"] == []
        assert float(printed[3]) == pytest.approx(row["ms_per_frame"], abs=0.006)
        assert float(printed[4]) == pytest.approx(row["frames_per_second"], abs=0.06)
        assert printed[5] == str(row["ops_per_step"]) and printed[6] == "n/a (CPU)"
        # --list-kernels: the step's ops by name, most frequent first, adding up to the count
        assert sum(row["step_ops"].values()) == row["ops_per_step"]
        assert list(row["step_ops"].values()) == sorted(row["step_ops"].values(), reverse=True)
        listed = f"  bf16 eager batch {batch}: {row['ops_per_step']} ATen ops in one step, {len(row['step_ops'])} distinct:"
        assert listed in output
        name, count = next(iter(row["step_ops"].items()))
        assert f"    {count:5d}  {name}" in output
        assert row["peak_gib"] is None and row["planned_gib"] > 0 and row["compile_s"] >= 0
    assert "compile, capture and autotuning" not in output  # eager rows compile nothing
    assert numbers["build_s"] > 0


@pytest.mark.slow
def test_a_dry_run_traces_the_compiled_step_whole(gpu_benchmark, tmp_path, capsys):
    """compiled: the step's fullgraph trace (aot_eager on a CPU, inductor + CUDA graphs on a GPU);
    its profiled step spends host time in dynamo's guards, the eager one none."""
    path = tmp_path / "numbers.json"
    gpu_benchmark.main([*QUICK, "--modes", "compiled", "eager", "--batches", "1", "--json", str(path)])
    output = capsys.readouterr().out
    _, rows = table(output)
    assert [row[1] for row in rows] == ["compiled", "eager"] and rows[0][-1] == "n/a (CPU)"
    compiled, eager = json.loads(path.read_text())["rows"]
    # the compile's seconds: the warm-up less the timed run, printed under the compiled row
    assert 0 < compiled["compile_s"] < compiled["warm_up_s"] and 0 < compiled["compile_cpu_s"]
    assert (f"  bf16 compiled batch 1: compile, capture and autotuning {compiled['compile_s']:.1f} s "
            f"({compiled['compile_cpu_s']:.1f} s of CPU; the warm-up's {compiled['warm_up_s']:.1f} s") in output
    assert compiled["guard_ms"] > 0 and eager["guard_ms"] == 0
    assert 0 < compiled["guard_ms"] < compiled["host_ms"]  # the guards are part of the step's host work
    assert compiled["graphs_compiled_after_warm_up"] == 0


def test_the_compiled_mode_is_what_generate_compiles_on_a_gpu(gpu_benchmark):
    from transformers_drama3.decoding.loop import default_compile_config

    assert gpu_benchmark.compile_config_of("compiled", "cuda") == default_compile_config()
    on_cpu = gpu_benchmark.compile_config_of("compiled", "cpu")
    assert on_cpu.fullgraph and on_cpu.backend == "aot_eager" and on_cpu.mode is None  # no CUDA graphs on a CPU
    assert on_cpu.dynamic == default_compile_config().dynamic  # the same graphs over the batch sizes
    assert gpu_benchmark.compile_config_of("eager", "cuda") is None


def test_a_skipped_cuda_graph_is_a_failure_naming_the_graph(gpu_benchmark):
    label = "bf16 compiled batch 8"
    assert gpu_benchmark.capture_failures(label, 0, [], graph_launches=1) == []
    assert gpu_benchmark.capture_failures("bf16 in-order batch 8", 0, [], graph_launches=2, expected_graphs=2) == []
    counted = gpu_benchmark.capture_failures(label, 1, [], graph_launches=1)
    assert len(counted) == 1 and label in counted[0] and "cudagraph_skips" in counted[0]
    logged = gpu_benchmark.capture_failures(label, 1, ["feed: skipping cudagraphs due to cpu device (_tensor_constant0)"], 1)
    assert logged == [f"{label}, feed: skipping cudagraphs due to cpu device (_tensor_constant0)"]
    assert "no CUDA graph" in gpu_benchmark.capture_failures(label, 0, [], graph_launches=0)[0]
    assert "partitions" in gpu_benchmark.capture_failures(label, 0, [], graph_launches=2)[0]
    with pytest.raises(gpu_benchmark.GraphsNotCaptured, match=f"NOT CAPTURED: {label}, feed: skipping cudagraphs"):
        gpu_benchmark.check_captured(logged)
    gpu_benchmark.check_captured([])


def test_kernels_are_the_profilers_device_events_but_copies_memsets_and_synchronisations(gpu_benchmark):
    kernels = ["triton_poi_fused_add_mul_0", "void at::native::vectorized_elementwise_kernel<4>", "nvjet_tst_64x8"]
    others = ["Memcpy DtoD (Device -> Device)", "Memset (Device)", "Stream Sync", "Event Sync", "Stream Wait Event"]
    assert all(gpu_benchmark.is_kernel(name) for name in kernels)
    assert not any(gpu_benchmark.is_kernel(name) for name in others)


def test_the_skip_log_keeps_torchs_skipping_cudagraphs_lines(gpu_benchmark):
    inductor = logging.getLogger("torch._inductor.cudagraph_utils")
    with gpu_benchmark.CudagraphSkipLog() as skips:
        inductor.warning("skipping cudagraphs due to cpu device (_tensor_constant0)")
        inductor.warning("something else")
    inductor.warning("skipping cudagraphs due to mutated inputs")  # after the watch: not collected
    assert skips.lines == ["a graph of the step: skipping cudagraphs due to cpu device (_tensor_constant0)"]


def test_a_run_with_a_graph_not_captured_exits_non_zero_after_its_table(gpu_benchmark, monkeypatch, capsys):
    def skipped(model, codec, arguments, mode, batch, device, bandwidth, gb_per_step):
        return gpu_benchmark.Row("bf16", mode, batch, 1.0, batch * 1000.0, 10, "CUDA kernels", 3, gb_per_step, 0.5, 2.0,
                                 5.0, 6.0, "no", [f"bf16 {mode} batch {batch}, draw: skipping cudagraphs due to test"])

    monkeypatch.setattr(gpu_benchmark, "measure", skipped)
    with pytest.raises(SystemExit) as exited:
        gpu_benchmark.main([*QUICK, "--modes", "compiled", "--batches", "1"])
    assert exited.value.code == 1
    output = capsys.readouterr().out
    assert "NOT CAPTURED: bf16 compiled batch 1, draw: skipping cudagraphs due to test" in output
    assert output.index("| bf16 | compiled | 1 |") < output.index("NOT CAPTURED")


def test_fp8_experts_are_refused_before_building_when_the_quantiser_is_missing(gpu_benchmark, monkeypatch):
    monkeypatch.setitem(sys.modules, gpu_benchmark.FP8_MODULE, None)  # import fails
    monkeypatch.setattr(gpu_benchmark, "materialised", lambda *args: pytest.fail("built before the refusal"))
    with pytest.raises(SystemExit, match=r"--experts fp8: .*fp8_expert_layer\.quantize_experts_fp8 is not importable"):
        gpu_benchmark.main([*QUICK, "--experts", "fp8"])


def test_a_dry_run_with_fp8_experts_reads_the_fp8_bytes(gpu_benchmark, tmp_path):
    try:
        gpu_benchmark.fp8_quantizer()
    except SystemExit as refused:
        pytest.skip(str(refused))
    path = tmp_path / "numbers.json"
    gpu_benchmark.main([*QUICK, "--experts", "fp8", "--modes", "eager", "--batches", "1", "--json", str(path)])
    row = json.loads(path.read_text())["rows"][0]
    config = gpu_benchmark.published_config(gpu_benchmark.DRY_RUN_LAYERS, dry_run=True)
    assert row["experts"] == "fp8"
    assert row["gb_per_step"] * 1e9 == pytest.approx(gpu_benchmark.weights_read_per_step(config, "fp8", 1))


def test_the_prefill_graphs_mode_prefills_its_prompt_padded_to_the_bucket(gpu_benchmark):
    """`--modes prefill-graphs` runs the compiled step with the compiled prefill of the prompt's
    length bucket (13 rows -> 16), the other modes the prompt as it is."""
    from transformers_drama3.decoding.loop import prefill_bucket

    config = gpu_benchmark.published_config(4, dry_run=True)
    model = gpu_benchmark.build(config, "cpu", torch.float32, "bf16")
    with torch.no_grad():
        graphed = gpu_benchmark.start_run(model, 1, 13, 12, "prefill-graphs", "cpu")
        plain = gpu_benchmark.start_run(model, 1, 13, 12, "compiled", "cpu")
    assert graphed.cache.backbone_part.filled == prefill_bucket(13) == 16 and plain.cache.backbone_part.filled == 13
    torch.testing.assert_close(graphed.state.hidden, plain.state.hidden, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_the_in_order_mode_steps_draw_and_feed_as_the_text_stream_does(gpu_benchmark, tmp_path, capsys, monkeypatch):
    """in-order: the compiled step through `DecodeRun.steps()` (two graphs a step), timed after its
    own warm-up (nothing compiled after it); the compiled mode through `steps_ahead()`."""
    from transformers_drama3.decoding.loop import DecodeRun

    called = []
    for name in ("steps", "steps_ahead"):
        original = getattr(DecodeRun, name)
        monkeypatch.setattr(DecodeRun, name, lambda self, original=original, name=name: (called.append(name), original(self))[1])
    torch._dynamo.reset()  # graphs an earlier test compiled would not be compiled again here
    path = tmp_path / "numbers.json"
    gpu_benchmark.main([*QUICK, "--modes", "in-order", "compiled", "--batches", "1", "--json", str(path)])
    _, rows = table(capsys.readouterr().out)
    assert [row[1] for row in rows] == ["in-order", "compiled"]
    in_order, compiled = json.loads(path.read_text())["rows"]
    assert in_order["graphs_compiled"] == 2 and compiled["graphs_compiled"] == 1  # draw + feed; the step
    assert in_order["graphs_compiled_after_warm_up"] == compiled["graphs_compiled_after_warm_up"] == 0
    assert called == ["steps"] * 3 + ["steps_ahead"] * 3  # warm-up, timed, profiled


def test_batch_sizes_whose_memory_does_not_fit_the_gpu_are_left_out_naming_each(gpu_benchmark):
    """The published model at 40 layers (bf16 experts: 60 GiB of them), a compiled run of 256 + 40 + 2
    rows (capacity 512): what fits is decided by the planner's bytes (weights, codec, state, the
    batch's 256-row prompts prefilled at once, workspace) against the free memory less 10%."""
    from transformers_drama3.placement.planning import GIB, plan_memory

    config = gpu_benchmark.published_config(40, dry_run=False)
    batches, rows, prompt_rows = [1, 8, 32, 64], 298, 256

    def total(batch, experts="none"):
        return plan_memory(config, experts, streams=batch, context=512, prefill_rows=batch * prompt_rows).total

    assert gpu_benchmark.batches_that_fit(config, "bf16", batches, rows, prompt_rows, 200 * GIB) == (batches, [])
    between = int((total(32) + total(64)) / 2 / 0.9)  # batch 32 fits, batch 64 does not
    kept, refused = gpu_benchmark.batches_that_fit(config, "bf16", batches, rows, prompt_rows, between)
    assert kept == [1, 8, 32] and len(refused) == 1
    assert refused[0].startswith("--experts bf16 batch 64: needs ") and "64 x 512 rows" in refused[0]
    assert f"{total(64) / GIB:.1f} GiB" in refused[0] and "16384-row prefill" in refused[0]
    # too little for the bf16 weights, enough for the FP8 ones (1 byte per expert weight)
    small = int(total(1, "fp8") / 0.9) + GIB
    assert gpu_benchmark.batches_that_fit(config, "bf16", [1], rows, prompt_rows, small)[0] == []
    assert gpu_benchmark.batches_that_fit(config, "fp8", [1], rows, prompt_rows, small)[0] == [1]


def test_the_prefills_transients_decide_a_batch_that_the_weights_and_state_alone_would_admit(gpu_benchmark):
    """bf16 experts at batch 32: free memory that holds the weights, codec and state less 10% with
    room to spare, but not the 32 x 256-row prefill's transients (its tower logits alone 1.1 GiB)
    and the workspace, leaves the batch out."""
    from transformers_drama3.placement.planning import GIB

    config = gpu_benchmark.published_config(40, dry_run=False)
    plan = gpu_benchmark.batch_plan(config, "bf16", 32, 298, 256)
    assert plan.prefill >= 1.1 * GIB and plan.transients > 2 * GIB
    free = int((plan.total - plan.transients + GIB) / 0.9)  # 1 GiB to spare without the transients
    assert gpu_benchmark.batches_that_fit(config, "bf16", [32], 298, 256, free)[0] == []
    assert gpu_benchmark.batches_that_fit(config, "bf16", [32], 298, 256, int(plan.total / 0.9) + 1)[0] == [32]

"""Full fine-tuning under DeepSpeed ZeRO-3 through accelerate, proved on CPU processes (gloo).

`accelerate launch` runs the SHIPPED config (examples/accelerate/deepspeed_zero3.yaml) with only the
process count (2) and mixed precision (no: float32, to compare within float32 tolerance) overridden
on its command line, and examples/train.py's `--cpu`: with `use_cpu` accelerate starts a gloo group
over both processes, the Trainer's accelerator takes DeepSpeed from the launcher's environment, and
DeepSpeed runs its CPU accelerator on that group. The model is the tiny published-layout checkpoint
with block-FP8 routed experts of tests/test_fsdp_training.py, so the 16-bit gathered save
(`zero3_save_16bit_model`) is checked against the published layout too.

DeepSpeed is not a dependency of the package: the launches are skipped where it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

from test_fsdp_training import FP8_DTYPE, environment, prepare_run, raw, requantised, stored, train
from transformers_drama3 import Drama3ForSpeechGeneration

ROOT = Path(__file__).resolve().parents[1]
ZERO3_CONFIG = ROOT / "examples" / "accelerate" / "deepspeed_zero3.yaml"
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path]:
    return prepare_run(tmp_path_factory.mktemp("zero3"))


def zero3(output: Path, model_dir: Path, data_dir: Path, *extra: str, port: int = 29631) -> tuple[list, str]:
    """examples/train.py under the shipped ZeRO-3 config, 2 CPU processes of batch 2 (global 4)."""
    log = output.with_suffix(".json")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ZERO3_CONFIG),
               "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(port),
               str(ROOT / "examples" / "train.py"), "--model", str(model_dir), "--data", str(data_dir),
               "--output", str(output), "--batch-size", "2", "--learning-rate", "3e-3", "--dtype", "float32",
               "--loss-log", str(log), *extra]
    result = subprocess.run(command, env=dict(environment(), DS_ACCELERATOR="cpu"), capture_output=True, text=True,
                            timeout=600)
    return result, log


@needs_deepspeed
@pytest.mark.slow
def test_zero3_run_of_the_shipped_config_equals_one_process_and_saves_the_published_layout(prepared, tmp_path):
    model_dir, data_dir = prepared
    one, _ = train(tmp_path / "one", model_dir, data_dir, "--max-steps", "3", "--optimizer", "adamw", sharded=False)
    result, log = zero3(tmp_path / "two", model_dir, data_dir, "--max-steps", "3", "--cpu")
    assert result.returncode == 0, result.stderr[-4000:]
    two = json.loads(log.read_text())

    # it really was DeepSpeed's ZeRO-3 engine, and rank 0 held half of the parameters
    summary = next(line for line in result.stdout.splitlines() if line.startswith("DeepSpeed ZeRO-3"))
    assert "(DeepSpeedEngine) over 2 processes" in summary, summary
    held, total = (int(word) for word in summary.split() if word.isdigit() and word != "2")
    assert 0.45 * total < held < 0.55 * total, summary

    assert len(one) == len(two) == 3 and one[-1] < one[0]
    assert two == pytest.approx(one, rel=1e-5)

    loaded, single, sharded = stored(model_dir), stored(tmp_path / "one" / "final"), stored(tmp_path / "two" / "final")
    # the published layout: the same names and dtypes as loaded (per-expert FP8 + scales)
    assert {n: t.dtype for n, t in sharded.items()} == {n: t.dtype for n, t in loaded.items()}
    # experts re-quantised exactly where the single-process save re-quantised them
    assert requantised(sharded, loaded) == requantised(single, loaded) != set()
    # dense tensors (float32) within float32 tolerance of the single process's (1e-5 at most seen,
    # against steps of 3e-3); the loaded models' experts within one FP8 code step
    for name, tensor in single.items():
        if tensor.dtype != FP8_DTYPE and not name.endswith("_scale_inv"):
            torch.testing.assert_close(sharded[name], tensor, rtol=1e-5, atol=5e-5, msg=name)
    weights_one = Drama3ForSpeechGeneration.from_pretrained(tmp_path / "one" / "final").state_dict()
    weights_two = Drama3ForSpeechGeneration.from_pretrained(tmp_path / "two" / "final").state_dict()
    assert weights_one.keys() == weights_two.keys()
    for name in (name for name in weights_one if ".mlp.experts." in name):
        torch.testing.assert_close(weights_two[name], weights_one[name], rtol=0.13, atol=1e-4, msg=name)


@needs_deepspeed
@pytest.mark.slow
def test_resuming_a_zero3_checkpoint_equals_the_uninterrupted_run(prepared, tmp_path):
    model_dir, data_dir = prepared
    steps = ("--max-steps", "4", "--cpu")
    result, log = zero3(tmp_path / "whole", model_dir, data_dir, *steps, "--save-steps", "2", port=29637)
    assert result.returncode == 0, result.stderr[-4000:]
    whole = json.loads(log.read_text())
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    # DeepSpeed's own checkpoint: the partitioned model and optimiser states of each rank
    assert (checkpoint / "latest").read_text().strip() == "global_step2"
    assert len(list((checkpoint / "global_step2").glob("*optim_states.pt"))) == 2
    result, log = zero3(tmp_path / "resumed", model_dir, data_dir, *steps, "--resume", str(checkpoint), port=29639)
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = json.loads(log.read_text())
    # the resumed run trained steps 3 and 4 only; its loss history is the checkpoint's two, then its own
    assert sum(line.startswith("{'loss'") for line in result.stdout.splitlines()) == 2
    assert len(whole) == 4 and resumed == pytest.approx(whole, rel=1e-6)
    final_whole, final_resumed = stored(tmp_path / "whole" / "final"), stored(tmp_path / "resumed" / "final")
    assert final_whole.keys() == final_resumed.keys()
    for name, tensor in final_whole.items():
        if tensor.dtype == FP8_DTYPE:
            assert raw(final_resumed[name]) == raw(tensor), name
        else:
            torch.testing.assert_close(final_resumed[name], tensor, rtol=1e-6, atol=1e-6, msg=name)


@needs_deepspeed
@pytest.mark.slow
def test_a_zero3_launch_without_gpus_or_cpu_flag_is_refused_before_loading(tmp_path):
    """Without `--cpu` on a machine with no GPU, accelerate counts 1 process and DeepSpeed 2: refused
    before any work (the model folder does not even exist)."""
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    result, log = zero3(tmp_path / "out", tmp_path / "missing", tmp_path / "none", "--max-steps", "1", port=29633)
    assert result.returncode != 0
    assert "a DeepSpeed launch on a machine without GPUs needs --cpu" in result.stderr
    assert not (tmp_path / "out").exists() and not log.exists()


@needs_deepspeed
@pytest.mark.slow
def test_drama3_trainer_refuses_a_process_count_accelerate_got_wrong(prepared, tmp_path):
    """A user's script without `use_cpu` under the ZeRO-3 launch on a machine with no GPU: accelerate
    counts 1 process, DeepSpeed 2; `Drama3Trainer` says so instead of DeepSpeed's batch assertion."""
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    model_dir, data_dir = prepared
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ZERO3_CONFIG),
               "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", "29635", __file__,
               str(model_dir), str(data_dir), str(tmp_path / "out")]
    result = subprocess.run(command, env=dict(environment(), DS_ACCELERATOR="cpu"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert "DeepSpeed runs 2 processes but accelerate counts 1" in result.stderr, result.stderr[-3000:]
    assert "train_batch_size is not equal" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_train_py_refuses_a_deepspeed_launch_without_gpus_or_cpu_flag(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train as train_script
    finally:
        sys.path.remove(str(ROOT / "examples"))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    output = tmp_path / "out"
    argv = ["--model", str(tmp_path / "missing"), "--data", str(tmp_path / "none"), "--output", str(output)]
    with pytest.raises(SystemExit, match="a DeepSpeed launch on a machine without GPUs needs --cpu"):
        train_script.train(train_script.parse_args(argv))
    assert not output.exists()
    train_script.check_args(train_script.parse_args([*argv, "--cpu"]))  # --cpu: accepted


def user_script(model_dir: str, data_dir: str, output: str) -> None:
    """What a user's own script does: TrainingArguments without use_cpu, then Drama3Trainer."""
    from transformers import AutoTokenizer, TrainingArguments

    from transformers_drama3.processing_drama3 import Drama3Processor
    from transformers_drama3.training import Drama3Trainer, TTSCollator

    args = TrainingArguments(output_dir=output, per_device_train_batch_size=2, max_steps=1, report_to=[],
                             remove_unused_columns=False, save_strategy="no")
    model = Drama3ForSpeechGeneration.from_pretrained(model_dir, dtype=torch.float32)
    processor = Drama3Processor(AutoTokenizer.from_pretrained(model_dir), codebook_size=model.config.codebook_size,
                                num_codebooks=model.config.num_codebooks)
    Drama3Trainer(model=model, args=args, train_dataset=datasets.load_from_disk(data_dir),
                  data_collator=TTSCollator(processor)).train()


if __name__ == "__main__":
    user_script(*sys.argv[1:4])

"""examples/train.py end to end, and two CPU processes (gloo) == one process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from training_helpers import stack_model, tokenizer, voice_examples

ROOT = Path(__file__).resolve().parents[1]


def prepared(tmp_path) -> tuple[Path, Path]:
    model_dir, data_dir = tmp_path / "model", tmp_path / "data"
    stack_model().save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    # equal-length examples: every item has the same number of rows in each loss bucket, so the mean
    # of per-process means equals the global mean
    examples = [{k: v for k, v in e.items() if k != "index"} for e in voice_examples(0, 8, frames=6)]
    datasets.Dataset.from_list(examples).save_to_disk(data_dir)
    return model_dir, data_dir


def run_train(tmp_path, model_dir, data_dir, name, processes, batch, *extra):
    log = tmp_path / f"{name}.json"
    command = [sys.executable]
    if processes > 1:
        command += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", "29533"]
    command += [str(ROOT / "examples" / "train.py"), "--model", str(model_dir), "--data", str(data_dir),
                "--output", str(tmp_path / name), "--batch-size", str(batch), "--max-steps", "3",
                "--learning-rate", "3e-3", "--cpu", "--loss-log", str(log), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(log.read_text())


@pytest.mark.slow
def test_two_gloo_processes_match_one_process_with_the_same_global_batch(tmp_path):
    model_dir, data_dir = prepared(tmp_path)
    one = run_train(tmp_path, model_dir, data_dir, "one", 1, 4, "--optimizer", "muon")
    two = run_train(tmp_path, model_dir, data_dir, "two", 2, 2, "--optimizer", "muon")
    assert len(one) == len(two) == 3
    assert two == pytest.approx(one, rel=1e-4)
    assert one[-1] < one[0]

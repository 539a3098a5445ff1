"""Full fine-tuning sharded with FSDP2 through accelerate, proved on CPU processes (gloo).

`accelerate launch` runs the SHIPPED config (examples/accelerate/fsdp2_single_node_8gpu.yaml) with
only the process count (2) and mixed precision (no: float32, to compare within float32 tolerance)
overridden on its command line, and examples/train.py's `--cpu` (gloo). The model is a tiny
published-layout checkpoint with block-FP8 routed experts (power-of-two scales, like
tests/test_save_roundtrip.py), so the sharded save is checked against the published layout too.
Its dense tensors are stored in float32 (the published ones are bfloat16), so that the saved
weights of the two runs can be compared within float32 tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from training_helpers import stack_config, stack_model, tokenizer, voice_examples
from transformers_drama3 import Drama3ForSpeechGeneration
from transformers_drama3.checkpoint.quantization import (
    FP8_DTYPE,
    is_routed_expert_weight,
    quantize_block_fp8_power_of_two,
    scale_rule,
    split_expert_weights,
)

ROOT = Path(__file__).resolve().parents[1]
FSDP_CONFIG = ROOT / "examples" / "accelerate" / "fsdp2_single_node_8gpu.yaml"
BLOCK_FP8 = {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# experts [256, 64] / [64, 256]: whole 128-blocks along the intermediate axis (see test_save_roundtrip)
TEXT = {"moe_intermediate_size": 256}


def environment() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]), OMP_NUM_THREADS="1")


def write_fp8_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """A published-layout checkpoint of the tiny training stack: float32 dense tensors, routed experts
    in block-FP8 with power-of-two scales; config with the published quantization_config."""
    directory.mkdir(parents=True)
    config = stack_config(**TEXT)
    config.quantization_config = BLOCK_FP8
    config.dtype = torch.float32
    config.save_pretrained(directory)
    tensors = {}
    for name, tensor in split_expert_weights(stack_model(**TEXT).state_dict()).items():
        if is_routed_expert_weight(name):
            tensors[name], tensors[name + "_scale_inv"] = quantize_block_fp8_power_of_two(tensor)
        else:
            tensors[name] = tensor.float()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    tokenizer().save_pretrained(directory)
    return tensors


def prepare_run(root: Path) -> tuple[Path, Path]:
    """The block-FP8 tiny checkpoint and 8 training examples under `root`: (model folder, data folder)."""
    write_fp8_checkpoint(root / "model")
    # equal-length examples: each process's batch has the same rows in every loss bucket, so the
    # mean of the per-process means is the global mean (as in test_training_distributed.py)
    examples = [{k: v for k, v in e.items() if k != "index"} for e in voice_examples(0, 8, frames=6)]
    datasets.Dataset.from_list(examples).save_to_disk(root / "data")
    return root / "model", root / "data"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path]:
    return prepare_run(tmp_path_factory.mktemp("fsdp"))


def train(output: Path, model_dir: Path, data_dir: Path, *extra: str, sharded: bool, port: int = 29611):
    """examples/train.py, one process (global batch 4) or sharded over 2 (2 each); returns
    (logged losses, stdout)."""
    if sharded:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG),
                   "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(port)]
        batch = "2"
    else:
        command, batch = [sys.executable], "4"
    log = output.with_suffix(".json")
    command += [str(ROOT / "examples" / "train.py"), "--model", str(model_dir), "--data", str(data_dir),
                "--output", str(output), "--batch-size", batch, "--learning-rate", "3e-3", "--dtype", "float32",
                "--cpu", "--loss-log", str(log), *extra]
    result = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(log.read_text()), result.stdout


def trained_steps(stdout: str) -> int:
    return sum(line.startswith("{'loss'") for line in stdout.splitlines())


def stored(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def requantised(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> set[str]:
    return {name for name, t in saved.items() if t.dtype == FP8_DTYPE and raw(t) != raw(loaded[name])}


@pytest.mark.slow
def test_fsdp_run_of_the_shipped_config_equals_one_process_and_saves_the_published_layout(prepared, tmp_path):
    model_dir, data_dir = prepared
    one, _ = train(tmp_path / "one", model_dir, data_dir, "--max-steps", "3", "--optimizer", "adamw", sharded=False)
    two, stdout = train(tmp_path / "two", model_dir, data_dir, "--max-steps", "3", "--optimizer", "adamw",
                        sharded=True)

    # it really was sharded: rank 0 held about half of the parameters
    summary = next(line for line in stdout.splitlines() if line.startswith("FSDP2 over 2 processes"))
    held, total = (int(word) for word in summary.split() if word.isdigit() and word != "2")
    assert 0.4 * total < held < 0.6 * total, summary

    assert len(one) == len(two) == 3 and one[-1] < one[0]
    assert two == pytest.approx(one, rel=1e-5)

    loaded, single, sharded = stored(model_dir), stored(tmp_path / "one" / "final"), stored(tmp_path / "two" / "final")
    # the published layout: the same names and dtypes as loaded (per-expert FP8 + scales)
    assert {n: t.dtype for n, t in sharded.items()} == {n: t.dtype for n, t in loaded.items()}
    assert {n: t.dtype for n, t in single.items()} == {n: t.dtype for n, t in loaded.items()}
    # experts re-quantised exactly where the single-process save re-quantised them, with the
    # power-of-two rule their loaded scales follow; unchanged experts keep their loaded bytes
    assert requantised(sharded, loaded) == requantised(single, loaded) != set()
    for name in requantised(sharded, loaded):
        assert scale_rule(sharded[name], sharded[name + "_scale_inv"]) == "power_of_two"

    # the gathered weights equal the single process's: dense tensors (float32) within float32
    # tolerance (the gradients differ in reduction order only; AdamW divides by sqrt(v), so an entry
    # with a gradient near zero moves the most: 1.4e-5 at most seen, against steps of 3e-3);
    # re-quantised experts, as the loader dequantises them, within one FP8 code step
    for name, tensor in single.items():
        if tensor.dtype != FP8_DTYPE and not name.endswith("_scale_inv"):
            torch.testing.assert_close(sharded[name], tensor, rtol=1e-5, atol=5e-5, msg=name)
    weights_one = Drama3ForSpeechGeneration.from_pretrained(tmp_path / "one" / "final").state_dict()
    weights_two = Drama3ForSpeechGeneration.from_pretrained(tmp_path / "two" / "final").state_dict()
    assert weights_one.keys() == weights_two.keys()
    for name in (name for name in weights_one if ".mlp.experts." in name):
        torch.testing.assert_close(weights_two[name], weights_one[name], rtol=0.13, atol=1e-4, msg=name)


@pytest.mark.slow
def test_resuming_a_sharded_checkpoint_equals_the_uninterrupted_sharded_run(prepared, tmp_path):
    model_dir, data_dir = prepared
    steps = ("--max-steps", "4", "--optimizer", "muon")
    whole, whole_out = train(tmp_path / "whole", model_dir, data_dir, *steps, "--save-steps", "2", sharded=True)
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    # accelerate's sharded checkpoint (torch.distributed.checkpoint): model and optimiser state
    assert (checkpoint / "pytorch_model_fsdp_0").is_dir() and (checkpoint / "optimizer_0").is_dir()
    resumed, resumed_out = train(tmp_path / "resumed", model_dir, data_dir, *steps, "--resume", str(checkpoint),
                                 sharded=True, port=29613)
    # the resumed run trained steps 3 and 4 only (Trainer prints each step's log); its loss history
    # is the checkpoint's two steps, then its own
    assert [trained_steps(whole_out), trained_steps(resumed_out)] == [4, 2]
    assert resumed == pytest.approx(whole, rel=1e-6)
    final_whole = stored(tmp_path / "whole" / "final")
    final_resumed = stored(tmp_path / "resumed" / "final")
    assert final_whole.keys() == final_resumed.keys()
    for name, tensor in final_whole.items():
        if tensor.dtype == FP8_DTYPE:
            assert raw(final_resumed[name]) == raw(tensor), name
        else:
            torch.testing.assert_close(final_resumed[name], tensor, rtol=1e-6, atol=1e-6, msg=name)


def test_muon_on_sharded_parameters_steps_like_muon_on_the_whole_matrices(tmp_path):
    """GatheringMuon on row-sharded DTensors == torch's Muon on the whole matrices (same gradients);
    torch's Muon run on the DTensors themselves is not (bfloat16 products reduced in another order)."""
    report = tmp_path / "muon.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29615",
               str(ROOT / "tests" / "fsdp_muon_worker.py"), str(report)]
    result = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    differences = json.loads(report.read_text())
    assert min(differences["moved"]) > 1e-2  # the steps moved every matrix
    assert max(differences["gathered"]) <= 1e-6
    assert max(differences["torch_on_shards"]) > 1e-4


@pytest.mark.parametrize("requested, processes", [("false", "MULTI_CPU"), ("true", "NO")])
def test_a_cpu_run_is_sharded_only_when_the_launcher_asked_and_processes_are_several(monkeypatch, requested, processes):
    """`shard_on_cpu` leaves a DDP run (no FSDP config) and a single process alone."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from transformers_drama3.training.distributed import shard_on_cpu

    monkeypatch.setenv("ACCELERATE_USE_FSDP", requested)
    state = SimpleNamespace(distributed_type=DistributedType[processes], mixed_precision="no")
    assert shard_on_cpu(SimpleNamespace(state=state)) is False
    assert state.distributed_type == DistributedType[processes] and not hasattr(state, "fsdp_plugin")

"""Drama 3 over several devices: a pipeline split of the backbone (`speech_device_map`, accelerate's
dispatch) and transformers' tensor-parallel plan, each speaking the greedy frames of one device.

On a CPU machine the split is forced with a `max_memory` map of "cpu" and "disk": the layers that do
not fit are offloaded and run through accelerate's hooks, as layers on a second GPU are. The
tensor-parallel plan runs in 2 gloo processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.utils import compute_module_sizes

from generation_helpers import prompt, tiny_model
from transformers_drama3 import Drama3ForSpeechGeneration
from transformers_drama3.placement.device_map import speech_device_map

ROOT = Path(__file__).resolve().parents[1]


def greedy(model, seed: int = 0) -> torch.Tensor:
    ids, codes = prompt(seed)
    return model.generate(ids[None], codes[None], do_sample=False, max_new_tokens=6,
                          return_dict_in_generate=True).audio_codes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(directory)
    return directory


def layer_bytes(model) -> tuple[int, int]:
    sizes = compute_module_sizes(model, dtype=torch.float32)
    layers = sum(sizes[f"model.language_model.layers.{i}"] for i in range(len(model.backbone.layers)))
    return sizes[""] - layers, sizes["model.language_model.layers.0"]


def test_a_split_over_two_devices_speaks_the_frames_of_one_device(checkpoint, tmp_path):
    whole = Drama3ForSpeechGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    rest, layer = layer_bytes(whole)
    # the first "device" holds the heads, the tower and two decoder layers; the rest go to disk
    max_memory = {"cpu": rest + 2 * layer + layer // 2, "disk": "1GiB"}
    device_map = speech_device_map(whole.config, max_memory, dtype=torch.float32)
    split = Drama3ForSpeechGeneration.from_pretrained(checkpoint, dtype=torch.float32, device_map=device_map,
                                                      offload_folder=str(tmp_path / "offload"))
    layers = [split.hf_device_map[f"model.language_model.layers.{i}"] for i in range(len(split.backbone.layers))]
    assert layers == ["cpu", "cpu", "disk", "disk"]
    assert {split.hf_device_map[name] for name in ("lm_head", "audio_decoder", "audio_decoder_mtp")} == {"cpu"}
    for seed in (0, 1):
        assert torch.equal(greedy(split, seed), greedy(whole, seed))


def test_a_max_memory_too_small_for_the_first_device_is_refused_by_name(checkpoint):
    model = Drama3ForSpeechGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    rest, _ = layer_bytes(model)
    with pytest.raises(ValueError, match=r"max_memory\['cpu'\] is 1000 bytes"):
        speech_device_map(model.config, {"cpu": 1000}, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"decoder layer model\.language_model\.layers\.0 .* fits in none"):
        speech_device_map(model.config, {"cpu": rest + 10}, dtype=torch.float32)


@pytest.mark.slow
def test_tensor_parallel_plan_auto_over_two_gloo_processes_speaks_the_frames_of_one_process(checkpoint, tmp_path):
    report = tmp_path / "tp.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29641",
               str(ROOT / "tests" / "tensor_parallel_worker.py"), str(checkpoint), str(report)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(report.read_text())
    # the attention projections are sharded (half the output rows on each rank), the rest replicated
    assert outcome["q_proj_local_rows"] * 2 == outcome["q_proj_rows"]
    assert outcome["equal_frames"] == [True, True]

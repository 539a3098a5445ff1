"""examples/finetune_voice_lora.py: a wav + txt folder -> adapter -> merged checkpoint in the published layout."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from model_helpers import published_tensor_names
from training_helpers import codec, stack_model, tokenizer, write_voice_folder
from transformers_drama3 import Drama3ForSpeechGeneration

ROOT = Path(__file__).resolve().parents[1]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_finetune_voice_lora_example_runs_end_to_end(tmp_path):
    model_dir = tmp_path / "model"
    stack_model().save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    codec().save_pretrained(model_dir / "codec")
    voice = write_voice_folder(tmp_path / "voice", count=3)
    output = tmp_path / "out"
    load_example("finetune_voice_lora").main([
        "--model", str(model_dir), "--voice", str(voice), "--output", str(output), "--rank", "4",
        "--max-steps", "3", "--batch-size", "2", "--learning-rate", "3e-3", "--min-seconds", "0.005",
        "--min-speech-fraction", "0", "--cpu",  # 15-30 ms fixture clips carry whole sentences
    ])
    assert (output / "adapter" / "adapter_config.json").exists()
    assert len(json.loads((output / "losses.json").read_text())) == 3
    merged = Drama3ForSpeechGeneration.from_pretrained(output / "merged")
    with safe_open(str(output / "merged" / "model.safetensors"), "pt") as handle:
        assert set(handle.keys()) == published_tensor_names(merged.config)

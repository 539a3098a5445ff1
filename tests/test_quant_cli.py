"""`drama3 say --quant` and `drama3 serve --quant`: the command-line routes to quantised weights
(the quantisation itself is tested in test_quantized_experts.py)."""

from __future__ import annotations

import pytest
import soundfile
import torch

from transformers_drama3 import cli
from transformers_drama3.checkpoint.quantization.experts import Drama3RoutedExperts
from transformers_drama3.serving.service import SpeechService


def expert_weight_type(model) -> str:
    experts = model.backbone.layers[0].mlp.experts
    assert isinstance(experts, Drama3RoutedExperts)
    return type(experts[0].gate_proj.weight).__name__


def test_say_quant_speaks_with_quantised_experts(tmp_path, monkeypatch):
    loaded = {}
    real = cli.load_model_and_processor

    def spy(*args, **kwargs):
        loaded["model"], processor = real(*args, **kwargs)
        return loaded["model"], processor

    monkeypatch.setattr(cli, "load_model_and_processor", spy)
    output = tmp_path / "q.wav"
    assert cli.main(["say", "Hello there.", "-o", str(output), "--quant", "int8", "--quiet", "--seed", "0"]) == 0
    audio, rate = soundfile.read(output)
    assert rate > 0 and audio.size > 0 and torch.isfinite(torch.from_numpy(audio)).all()
    assert expert_weight_type(loaded["model"]) not in {"Parameter", "Tensor"}


def test_serve_refuses_quant_with_adapters_before_loading(tmp_path, capsys):
    code = cli.main(["serve", "--quant", "int8", "--adapter-root", str(tmp_path), "--voices-dir", str(tmp_path / "v")])
    assert code != 0
    assert "--quant int8 with --adapter" in capsys.readouterr().err


def test_the_service_loads_quantised_weights_and_refuses_them_with_adapters(tmp_path):
    service = SpeechService.load(voices_dir=str(tmp_path / "voices"), quant="int8", start_engine=False, threads=1)
    assert expert_weight_type(service.model) not in {"Parameter", "Tensor"}
    with pytest.raises(ValueError, match="quant='int8' with adapters"):
        SpeechService.load(voices_dir=str(tmp_path / "voices"), quant="int8", adapter_root=str(tmp_path), start_engine=False)

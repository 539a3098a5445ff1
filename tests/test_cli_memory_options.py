"""`--quant` and `--offload-experts` of `drama3 say` / `drama3 serve`: the command-line routes to
quantised weights and offloaded experts (the quantisation itself is tested in
test_quantized_experts.py, the offload in test_offload.py)."""

from __future__ import annotations

import pytest
import soundfile
import torch

from transformers_drama3 import cli
from transformers_drama3.checkpoint.quantization.experts import Drama3RoutedExperts
from transformers_drama3.decoding.request import has_offloaded_experts, resolve_decoding
from transformers_drama3.layers.offloaded_experts import OffloadedExperts, offload_experts
from transformers_drama3.serving.service import SpeechService, default_prefill_chunk

from generation_helpers import tiny_model


def expert_weight_type(model) -> str:
    experts = model.backbone.layers[0].mlp.experts
    assert isinstance(experts, Drama3RoutedExperts)
    return type(experts[0].gate_proj.weight).__name__


def test_say_quant_speaks_with_quantised_experts(tmp_path, monkeypatch):
    audio, model = say(tmp_path, monkeypatch, "q.wav", "--quant", "int8")
    assert audio.size > 0 and torch.isfinite(torch.from_numpy(audio)).all()
    assert expert_weight_type(model) not in {"Parameter", "Tensor"}


def test_serve_refuses_quant_with_adapters_before_loading(tmp_path, capsys):
    code = cli.main(["serve", "--quant", "int8", "--adapter-root", str(tmp_path), "--voices-dir", str(tmp_path / "v")])
    assert code != 0
    assert "--quant int8 with --adapter" in capsys.readouterr().err


def test_the_service_loads_quantised_weights_and_refuses_them_with_adapters(tmp_path):
    service = SpeechService.load(voices_dir=str(tmp_path / "voices"), quant="int8", start_engine=False, threads=1,
                                 prefill_chunk=64)
    assert expert_weight_type(service.model) not in {"Parameter", "Tensor"}
    assert service.engine.prefill_chunk == 64  # --prefill-chunk reaches the engine
    unset = SpeechService.load(voices_dir=str(tmp_path / "voices"), start_engine=False, threads=1)
    assert unset.engine.prefill_chunk == default_prefill_chunk("cpu") == 128 < default_prefill_chunk("cuda") == 512
    with pytest.raises(ValueError, match="quant='int8' with adapters"):
        SpeechService.load(voices_dir=str(tmp_path / "voices"), quant="int8", adapter_root=str(tmp_path), start_engine=False)


def say(tmp_path, monkeypatch, name, *flags):
    loaded = {}
    real = cli.load_model_and_processor

    def spy(*args, **kwargs):
        loaded["model"], processor = real(*args, **kwargs)
        return loaded["model"], processor

    monkeypatch.setattr(cli, "load_model_and_processor", spy)
    output = tmp_path / name
    assert cli.main(["say", "Hello there.", "-o", str(output), "--quiet", "--seed", "0", *flags]) == 0
    return soundfile.read(output)[0], loaded["model"]


def test_say_offload_experts_speaks_the_resident_models_take(tmp_path, monkeypatch):
    resident, model = say(tmp_path, monkeypatch, "resident.wav")
    assert not has_offloaded_experts(model)
    offloaded, model = say(tmp_path, monkeypatch, "offloaded.wav", "--offload-experts", "2")
    assert has_offloaded_experts(model)
    assert all(module.capacity == 2 for module in model.modules() if isinstance(module, OffloadedExperts))
    assert resident.shape == offloaded.shape
    assert abs(resident - offloaded).max() < 1e-4


@pytest.mark.parametrize("flags,named", [
    (["--offload-experts", "0"], "--offload-experts 0"),
    (["--offload-experts", "2", "--quant", "int8"], "--offload-experts with --quant int8"),
])
def test_say_refuses_bad_offload_flags_before_loading(tmp_path, capsys, flags, named):
    assert cli.main(["say", "hi", "-o", str(tmp_path / "x.wav"), *flags]) != 0
    assert named in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists()


@pytest.mark.parametrize("flags", [["--offload-experts", "2", "--compile"], ["--offload-experts", "2", "--quant", "int8"],
                                   ["--offload-experts", "0"]])
def test_serve_refuses_bad_offload_flags_before_loading(tmp_path, capsys, flags):
    assert cli.main(["serve", "--voices-dir", str(tmp_path / "v"), *flags]) != 0
    assert "--offload-experts" in capsys.readouterr().err


def test_a_gpu_static_cache_is_not_compiled_by_default_once_experts_are_offloaded(monkeypatch):
    model = tiny_model(seed=0)
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    assert resolve_decoding(model, None, {"cache_implementation": "static"}).compile_config is not None
    offload_experts(model, cache_experts=2, device="cpu")
    assert resolve_decoding(model, None, {"cache_implementation": "static"}).compile_config is None

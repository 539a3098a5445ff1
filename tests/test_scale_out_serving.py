"""The folder `save_pretrained` writes (plus the tokenizer, as docs/fine_tuning.md does) holds every file
SGLang-Omni's Drama 3 pipeline reads, in the form it checks.

What SGLang-Omni reads, from sgl-project/sglang-omni (release 0.1.9):
- sglang_omni/config/manager.py: the pipeline is picked from `AutoConfig.from_pretrained(path)`'s
  `architectures`; sglang_omni/models/fishaudio_drama3/config.py registers "FishOmniModel".
- sglang_omni/models/fishaudio_drama3/hf_config.py: `model_type` "fish_omni", an
  `audio_decoder_config` of model_type "fish_qwen3_audio_decoder"; text_config.py: a text config
  of model_type "fish_omni_text" (or transformers' Qwen3.5-MoE text config).
- sglang_omni/models/fishaudio_drama3/quantization.py: `quantization_config` with quant_method
  "bsgemm-moe", activation_scheme "dynamic", weight_block_size [128, 128].
- sglang_omni/models/fishaudio_drama3/stages.py: `tokenizers.Tokenizer.from_file(<folder>/tokenizer.json)`;
  the codec is NOT read from the folder: `codec_path` (config.py, default the fishaudio/s2-pro
  repository) names a folder or file holding `codec.pth`.
- no file under sglang_omni/models/fishaudio_drama3/ reads generation_config.json (sampling
  defaults come with each request); transformers and this package's server read it.
vLLM-Omni's Drama 3 support (vllm-project/vllm-omni#8900) was not readable here; see docs/scale_out.md.
"""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from test_fsdp_training import BLOCK_FP8, TEXT
from training_helpers import stack_model, tokenizer
from transformers_drama3.checkpoint.quantization import FP8_DTYPE


def test_a_saved_voice_folder_holds_what_sglang_omni_reads(tmp_path):
    model = stack_model(**TEXT)
    model.config.quantization_config = BLOCK_FP8  # the published config's block-FP8 experts
    model.config.published_quantization_config = dict(BLOCK_FP8)
    folder = tmp_path / "my-voice"
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["FishOmniModel"]
    assert config["model_type"] == "fish_omni"
    assert config["text_config"]["model_type"] in ("fish_omni_text", "qwen3_5_moe_text")
    assert config["audio_decoder_config"]["model_type"] == "fish_qwen3_audio_decoder"
    assert config["quantization_config"] == BLOCK_FP8

    loaded = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert loaded.get_vocab_size() == len(tokenizer())

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
        expert = "model.language_model.layers.0.mlp.experts.0.gate_proj.weight"
        assert expert in names and expert + "_scale_inv" in names
        assert handle.get_tensor(expert).dtype == FP8_DTYPE
    assert not any("experts.gate_up_proj" in name for name in names)  # per-expert names only

    assert not (folder / "codec.pth").exists()  # the codec comes from codec_path, not the folder
    generation = json.loads((folder / "generation_config.json").read_text())
    assert {"temperature", "top_p", "max_new_tokens", "eos_token_id"} <= generation.keys()

"""Load a published-layout checkpoint, save it: the same tensors, dtypes and bytes come back.

The checkpoints here are written with safetensors directly (not through the project's save path),
in the published layout: bfloat16 tensors, float32 `A_log`, and block-FP8 routed experts whose
scales follow another rule than the project's quantiser (powers of two), over blocks of very
different magnitudes, so that re-quantising would change their bytes.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from model_helpers import make_rows, random_frames, tiny_config, tiny_model
from safetensors import safe_open
from safetensors.torch import save_file

import transformers_drama3  # noqa: F401  (registers the Auto classes)
from transformers import AutoModel
from transformers_drama3 import Drama3ForSpeechGeneration
from transformers_drama3.placement.accounting import round_trip_memory
from transformers_drama3.checkpoint.loaded_checkpoint import published_state_dict
from transformers_drama3.checkpoint.quantization import (
    FP8_DTYPE,
    dequantize_block_fp8,
    is_routed_expert_weight,
    quantize_block_fp8_power_of_two,
    scale_rule,
    split_expert_weights,
)

BLOCK_FP8 = {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# Experts of [256, 64] / [64, 256]: two blocks of 128 along the intermediate axis. (transformers 5.24
# derives the block size from the scale grid, rows // grid rows, so a partial edge block among
# several would dequantise wrongly on load; the published sizes, 512 and 2048, are whole blocks.)
TEXT = {"moe_intermediate_size": 256}
EXPERT = "model.language_model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def blockwise_magnitudes(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`weight` with each 128 x 128 block scaled by its own factor in 1e-3 .. 1e1."""
    rows, columns = weight.shape
    grid = (math.ceil(rows / 128), math.ceil(columns / 128))
    factors = 10.0 ** (4 * torch.rand(grid, generator=generator) - 3)
    return weight * factors.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :columns]


def published_tensors(fp8: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny model's tensors in the published layout and dtypes."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in split_expert_weights(tiny_model(seed, text=TEXT).state_dict()).items():
        if name.endswith(".linear_attn.A_log"):
            tensors[name] = tensor.float()
        elif is_routed_expert_weight(name) and fp8:
            tensors[name], tensors[name + "_scale_inv"] = quantize_block_fp8_power_of_two(
                blockwise_magnitudes(tensor, generator)
            )
        else:
            tensors[name] = tensor.to(torch.bfloat16)
    return tensors


def write_published(directory, fp8: bool, shards: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a published-layout checkpoint (config.json with dtype bfloat16; one file, or `shards`
    files with an index) and return its tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(text=TEXT, **({"quantization_config": BLOCK_FP8} if fp8 else {}))
    config.dtype = torch.bfloat16
    config.save_pretrained(directory)
    tensors = published_tensors(fp8, seed)
    if shards == 1:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return tensors
    names = list(tensors)
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for index in range(shards):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = names[index * per_shard : (index + 1) * per_shard]
        save_file({name: tensors[name] for name in part}, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return tensors


def stored_files(directory) -> dict[str, dict[str, tuple[torch.dtype, tuple, bytes]]]:
    """file name -> tensor name -> (dtype, shape, raw bytes)."""
    files = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            files[path.name] = {
                name: _raw(handle.get_tensor(name)) for name in handle.keys()
            }
    return files


def _raw(tensor: torch.Tensor) -> tuple[torch.dtype, tuple, bytes]:
    return tensor.dtype, tuple(tensor.shape), tensor.contiguous().view(torch.uint8).numpy().tobytes()


def stored_tensors(directory) -> dict[str, tuple[torch.dtype, tuple, bytes]]:
    return {name: raw for tensors in stored_files(directory).values() for name, raw in tensors.items()}


def changed_tensors(first, second) -> set[str]:
    assert set(first) == set(second)
    return {name for name in first if first[name] != second[name]}


def prompt():
    return make_rows([5, 6, 7, 8], random_frames(4, torch.Generator().manual_seed(0)))


# ----------------------------------------------------------------------------- untouched round trip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "auto"], ids=["float32", "bfloat16", "auto"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_untouched_checkpoint_saves_the_same_tensors_dtypes_bytes_and_config(tmp_path, fp8, dtype):
    write_published(tmp_path / "published", fp8)
    model = AutoModel.from_pretrained(tmp_path / "published", dtype=dtype)
    assert model.save_pretrained(tmp_path / "saved") == []
    assert stored_files(tmp_path / "saved") == stored_files(tmp_path / "published")
    saved_config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved_config == json.loads((tmp_path / "published" / "config.json").read_text())
    assert saved_config["architectures"] == ["FishOmniModel"] and saved_config["dtype"] == "bfloat16"


def test_published_dtypes_survive_a_round_trip(tmp_path):
    """The issue's symptoms, stated directly: A_log stays float32, experts stay FP8 with their scales."""
    published = write_published(tmp_path / "published", fp8=True)
    AutoModel.from_pretrained(tmp_path / "published", dtype=torch.bfloat16).save_pretrained(tmp_path / "saved")
    saved = stored_tensors(tmp_path / "saved")
    a_log = "model.language_model.layers.0.linear_attn.A_log"
    assert saved[a_log][0] == torch.float32 and saved[a_log] == _raw(published[a_log])
    expert = EXPERT.format(layer=1, expert=3, projection="down_proj")
    assert saved[expert][0] == FP8_DTYPE and saved[expert + "_scale_inv"][0] == torch.float32
    assert saved[expert + "_scale_inv"] == _raw(published[expert + "_scale_inv"])


def test_sharded_checkpoint_saves_into_the_same_shards_and_index(tmp_path):
    write_published(tmp_path / "published", fp8=True, shards=3)
    AutoModel.from_pretrained(tmp_path / "published", dtype=torch.float32).save_pretrained(tmp_path / "saved")
    assert stored_files(tmp_path / "saved") == stored_files(tmp_path / "published")
    index = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())
    assert index == json.loads((tmp_path / "published" / "model.safetensors.index.json").read_text())


def test_shards_too_large_for_max_shard_size_are_cut_again(tmp_path):
    write_published(tmp_path / "published", fp8=True, shards=2)
    model = AutoModel.from_pretrained(tmp_path / "published", dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved", max_shard_size=200_000)
    files = stored_files(tmp_path / "saved")
    assert len(files) > 2 and all(name.endswith(f"-of-{len(files):05d}.safetensors") for name in files)
    for tensors in files.values():
        sizes = [len(raw) for _, _, raw in tensors.values()]
        assert sum(sizes) <= 200_000 or len(sizes) == 1
    assert stored_tensors(tmp_path / "saved") == stored_tensors(tmp_path / "published")
    weight_map = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map == {name: file for file, tensors in files.items() for name in tensors}


def test_saving_over_the_loaded_folder_keeps_its_bytes(tmp_path):
    published = write_published(tmp_path / "published", fp8=True, shards=2)
    expected = stored_files(tmp_path / "published")
    AutoModel.from_pretrained(tmp_path / "published", dtype=torch.bfloat16).save_pretrained(tmp_path / "published")
    assert stored_files(tmp_path / "published") == expected
    assert not [p for p in (tmp_path / "published").iterdir() if p.name.startswith(".")]  # no temp files left
    assert len(published) == len(stored_tensors(tmp_path / "published"))


def test_saved_model_computes_the_loaded_models_logits(tmp_path):
    write_published(tmp_path / "published", fp8=True, shards=2)
    loaded = AutoModel.from_pretrained(tmp_path / "published", dtype=torch.float32)
    loaded.save_pretrained(tmp_path / "saved")
    reloaded = AutoModel.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    input_ids, audio_codes = prompt()
    with torch.no_grad():
        before, after = loaded(input_ids, audio_codes), reloaded(input_ids, audio_codes)
    torch.testing.assert_close(after.logits, before.logits)
    torch.testing.assert_close(after.codebook_logits, before.codebook_logits)


def test_state_dict_loaded_directly_is_saved_back_as_given(tmp_path):
    """Trainer's resume path: `load_state_dict` of a published-layout file, then save."""
    published = write_published(tmp_path / "published", fp8=True)
    model = Drama3ForSpeechGeneration(tiny_config(text=TEXT, quantization_config=BLOCK_FP8)).to(torch.bfloat16)
    model.load_state_dict(dict(published))
    model.save_pretrained(tmp_path / "saved")
    assert stored_tensors(tmp_path / "saved") == stored_tensors(tmp_path / "published")


def test_tensors_the_model_ignores_on_load_are_written_back(tmp_path):
    """`mtp.*` tensors (the model skips them on load, `_keys_to_ignore_on_load_unexpected`) are
    part of the folder: a round trip keeps them."""
    directory = tmp_path / "published"
    published = write_published(directory, fp8=True)
    published["mtp.layers.0.eh_proj.weight"] = torch.randn(8, 16).to(torch.bfloat16)
    save_file(published, directory / "model.safetensors", metadata={"format": "pt"})
    AutoModel.from_pretrained(directory, dtype=torch.float32).save_pretrained(tmp_path / "saved")
    assert stored_tensors(tmp_path / "saved") == stored_tensors(directory)


# ----------------------------------------------------------------------------- changed weights


def test_a_trained_expert_alone_is_requantised_with_the_loaded_scale_rule(tmp_path):
    published = write_published(tmp_path / "published", fp8=True)
    model = AutoModel.from_pretrained(tmp_path / "published", dtype=torch.float32)
    experts = model.backbone.layers[2].mlp.experts
    with torch.no_grad():
        experts.down_proj[1] += 0.01 * torch.randn_like(experts.down_proj[1])
    trained = experts.down_proj[1].clone()
    name = EXPERT.format(layer=2, expert=1, projection="down_proj")
    assert model.save_pretrained(tmp_path / "saved") == [name]
    before, after = stored_tensors(tmp_path / "published"), stored_tensors(tmp_path / "saved")
    assert changed_tensors(before, after) == {name, name + "_scale_inv"}
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as handle:
        weight_fp8, scale_inv = handle.get_tensor(name), handle.get_tensor(name + "_scale_inv")
    assert scale_rule(published[name], published[name + "_scale_inv"]) == "power_of_two"
    assert scale_rule(weight_fp8, scale_inv) == "power_of_two"
    dense = dequantize_block_fp8(weight_fp8, scale_inv, dtype=torch.float32)
    scale = scale_inv.repeat_interleave(128, 0)[: dense.shape[0]].repeat_interleave(128, 1)[:, : dense.shape[1]]
    # e4m3 rounding: 2^-4 of an element (normal range), 2^-9 of its block scale (subnormal)
    assert ((dense - trained).abs() <= trained.abs() / 16 + scale / 512).all()
    reloaded = AutoModel.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    assert torch.equal(reloaded.backbone.layers[2].mlp.experts.down_proj[1], dense)


def randomise_lora(peft_model, generator: torch.Generator) -> None:
    """Give every adapter a non-zero update (LoRA B starts at zero) and touch the fully trained
    modules, as training would."""
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))


@pytest.mark.parametrize("preset", ["light", "heavy"])
def test_lora_merged_save_changes_only_the_merged_tensors(tmp_path, preset):
    from transformers_drama3.training import apply_lora, merge_and_save

    write_published(tmp_path / "published", fp8=True)
    model = AutoModel.from_pretrained(tmp_path / "published", dtype=torch.float32)
    loaded_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    peft_model = apply_lora(model, preset, r=2, gradient_checkpointing=False)
    randomise_lora(peft_model, torch.Generator().manual_seed(1))
    merged = merge_and_save(peft_model, tmp_path / "merged")
    merged_state = merged.state_dict()
    changed_in_memory = {name for name in loaded_state if not torch.equal(loaded_state[name], merged_state[name])}
    assert changed_in_memory  # the adapters did something
    changed_on_disk = changed_tensors(stored_tensors(tmp_path / "published"), stored_tensors(tmp_path / "merged"))
    expert_names = {name for name in changed_on_disk if ".mlp.experts." in name}
    assert changed_on_disk - expert_names == changed_in_memory - {n for n in changed_in_memory if ".mlp.experts." in n}
    assert {"audio_decoder.codebook_embeddings.weight", "audio_decoder_mtp.heads.0.weight"} <= changed_on_disk
    assert not any("norm" in name or name.endswith("A_log") or "mlp.gate." in name for name in changed_on_disk)
    if preset == "light":
        assert not expert_names
    else:  # every routed expert got a LoRA update: all re-quantised (a power-of-two scale may stay)
        all_weights = {n for n in stored_tensors(tmp_path / "published") if is_routed_expert_weight(n)}
        assert {n for n in expert_names if is_routed_expert_weight(n)} == all_weights
    reloaded = AutoModel.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    reloaded_state = reloaded.state_dict()
    for name in changed_in_memory - {n for n in changed_in_memory if ".mlp.experts." in n}:
        # stored in bfloat16, as loaded
        assert torch.equal(reloaded_state[name], merged_state[name].to(torch.bfloat16).float()), name


def test_lora_merged_save_returns_the_requantised_experts(tmp_path):
    from transformers_drama3.training import apply_lora

    write_published(tmp_path / "published", fp8=True)
    model = AutoModel.from_pretrained(tmp_path / "published", dtype=torch.float32)
    peft_model = apply_lora(model, "heavy", r=2, gradient_checkpointing=False)
    randomise_lora(peft_model, torch.Generator().manual_seed(2))
    merged = peft_model.merge_and_unload()
    requantised = merged.save_pretrained(tmp_path / "merged")
    assert sorted(requantised) == sorted(n for n in stored_tensors(tmp_path / "published") if is_routed_expert_weight(n))


# ----------------------------------------------------------------------------- experts held in FP8


def test_experts_held_in_fp8_are_split_back_to_their_own_bytes(tmp_path):
    """transformers keeps the experts in FP8 on GPUs with FP8 kernels (`FP8Experts`: fused FP8
    weights beside fused scale grids). Built here on the CPU from the published tensors the way
    transformers' conversion fuses them, the published state dict gives each expert's bytes back."""
    published = write_published(tmp_path / "published", fp8=True)
    model = AutoModel.from_pretrained(tmp_path / "published", dtype=torch.bfloat16)
    state = dict(model.state_dict())
    config = model.config.text_config
    for layer in range(config.num_hidden_layers):
        prefix = f"model.language_model.layers.{layer}.mlp.experts"
        for fused, projections in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            for suffix, key in (("", ".weight"), ("_scale_inv", ".weight_scale_inv")):
                state[f"{prefix}.{fused}{suffix}"] = torch.stack([
                    torch.cat([published[f"{prefix}.{e}.{p}{key}"] for p in projections])
                    for e in range(config.num_experts)
                ])
    tensors, quantized = published_state_dict(state, None, (128, 128))
    assert quantized == []
    for name, tensor in published.items():
        if ".mlp.experts." in name:
            assert _raw(tensors[name]) == _raw(tensor), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpoint_loaded_on_a_gpu_saves_the_same_bytes(tmp_path):
    write_published(tmp_path / "published", fp8=True, shards=2)
    model = AutoModel.from_pretrained(tmp_path / "published", dtype=torch.bfloat16, device_map="cuda")
    assert model.save_pretrained(tmp_path / "saved") == []
    assert stored_files(tmp_path / "saved") == stored_files(tmp_path / "published")


# ----------------------------------------------------------------------------- push_to_hub, memory


class FakeHub:
    """Stands in for the Hub: records the repo and the files each upload would send."""

    def __init__(self):
        self.uploads = []

    def create_repo(self, repo_id, **kwargs):
        return type("Repo", (), {"repo_id": repo_id})()

    def upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        self.uploads.append((repo_id, stored_files(Path(working_dir))))


def test_push_to_hub_uploads_the_files_save_pretrained_writes(tmp_path, monkeypatch):
    from transformers.utils import hub

    fake = FakeHub()
    monkeypatch.setattr(hub, "hf_api", lambda: fake)
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda *a, **k: type("Card", (), {"save": lambda s, p: None})())
    monkeypatch.setattr(Drama3ForSpeechGeneration, "_upload_modified_files", fake.upload)
    write_published(tmp_path / "published", fp8=True, shards=2)
    model = AutoModel.from_pretrained(tmp_path / "published", dtype=torch.float32)
    model.push_to_hub("someone/voice")
    model.save_pretrained(tmp_path / "saved", push_to_hub=True, repo_id="someone/voice")
    expected = stored_files(tmp_path / "published")
    assert [repo for repo, _ in fake.uploads] == ["someone/voice", "someone/voice"]
    assert all(files == expected for _, files in fake.uploads)


def test_kept_memory_is_the_fp8_experts_and_narrowed_tensors(tmp_path):
    published = write_published(tmp_path / "published", fp8=True)
    expert_bytes = sum(
        t.numel() * t.element_size() for n, t in published.items() if ".mlp.experts." in n
    )
    a_log_bytes = sum(t.numel() * 4 for n, t in published.items() if n.endswith("A_log"))
    in_float32 = AutoModel.from_pretrained(tmp_path / "published", dtype=torch.float32)
    in_bfloat16 = AutoModel.from_pretrained(tmp_path / "published", dtype=torch.bfloat16)
    assert in_float32.loaded_checkpoint.kept_bytes == expert_bytes
    assert in_bfloat16.loaded_checkpoint.kept_bytes == expert_bytes + a_log_bytes
    dense = AutoModel.from_pretrained(write_dense(tmp_path / "dense"), dtype=torch.bfloat16)
    assert dense.loaded_checkpoint.kept_bytes == a_log_bytes
    # The meta-device accounting (its full-size figures are in the docs) counts the same bytes.
    for model in (in_float32, in_bfloat16):
        memory = round_trip_memory(model.config, model.dtype)
        assert memory.kept_bytes == model.loaded_checkpoint.kept_bytes


def test_full_size_round_trip_keeps_one_byte_per_routed_expert_parameter():
    memory = round_trip_memory(compute_dtype=torch.bfloat16)  # the full-size config, on the meta device
    # FP8 codes + one float32 scale per 128 x 128 block (512 and 2048 are whole blocks)
    assert memory.kept_bytes_per_routed_expert_parameter == 1 + 4 / (128 * 128)
    assert 0.4 < memory.overhead < 0.5  # below half the bf16 weights: not a second copy


def write_dense(directory):
    write_published(directory, fp8=False)
    return directory

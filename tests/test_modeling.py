"""Drama3ForSpeechGeneration: published layout, equivalences, losses, gradients."""

import json

import pytest
import torch
import torch.nn.functional as F
from model_helpers import (
    CODEBOOK_SIZE,
    EOS,
    NUM_CODEBOOKS,
    SEMANTIC_START,
    make_rows,
    published_tensor_names,
    random_frames,
    tiny_config,
    tiny_config_dict,
    tiny_model,
)
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForTextToWaveform

import transformers_drama3  # noqa: F401  (registers the Auto classes)
from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration
from transformers_drama3.checkpoint.quantization import dequantize_block_fp8, quantize_saved_experts

BLOCK_FP8 = {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def prompt_rows(seed=0, text=(5, 6, 7, 8), frames=4):
    generator = torch.Generator().manual_seed(seed)
    return make_rows(list(text), random_frames(frames, generator))


def write_published_checkpoint(model, directory, fp8=False):
    """Save `model` and, for fp8, turn it into the published block-FP8 layout."""
    model.save_pretrained(directory)
    if fp8:
        config = json.loads((directory / "config.json").read_text())
        config["quantization_config"] = BLOCK_FP8
        (directory / "config.json").write_text(json.dumps(config))
        quantize_saved_experts(directory)


# ----------------------------------------------------------------------------- registration, config


def test_auto_classes_resolve_fish_omni(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), Drama3Config)
    assert isinstance(AutoModel.from_pretrained(tmp_path), Drama3ForSpeechGeneration)
    assert isinstance(AutoModelForTextToWaveform.from_pretrained(tmp_path), Drama3ForSpeechGeneration)


def test_default_config_is_full_drama3():
    config = Drama3Config()
    text, tower = config.text_config, config.audio_decoder_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_experts, text.num_experts_per_tok) == (2048, 40, 256, 8)
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"] + text.layer_types[4:]
    assert text.layer_types.count("full_attention") == 10
    assert tower.num_tower_layers == 13
    assert (tower.n_head, tower.n_local_heads, tower.head_dim) == (16, 2, 256)
    assert config.semantic_end_token_id - config.semantic_start_token_id + 1 == 4096
    assert config.frame_rate == pytest.approx(44100 / 2048)


def test_published_config_round_trips_field_for_field(tmp_path):
    published = tiny_config_dict(quantization_config=BLOCK_FP8)
    config = Drama3Config(**published)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for key, value in published.items():
        if key in ("text_config", "audio_decoder_config"):
            for inner_key, inner_value in value.items():
                assert saved[key][inner_key] == inner_value, (key, inner_key)
        else:
            assert saved[key] == value, key


def test_qwen_model_type_in_text_config_is_accepted():
    config = Drama3Config(**tiny_config_dict(text={"model_type": "qwen3_5_moe_text"}))
    assert config.text_config.num_hidden_layers == 4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"semantic_end_token_id": SEMANTIC_START + 5}, "semantic band"),
        ({"eos_token_id": SEMANTIC_START + 1}, "inside the semantic band"),
        ({"speech_template_version": "other"}, "speech_template_version"),
        ({"text_config": tiny_config_dict()["text_config"] | {"rotary_interleaved": True}}, "rotary_interleaved"),
        ({"text_config": tiny_config_dict()["text_config"] | {"mlp_layer_types": ["dense"] * 4}}, "mlp_layer_types"),
        ({"audio_decoder_config": tiny_config_dict()["audio_decoder_config"] | {"n_layer": 3}}, "n_layer"),
    ],
)
def test_inconsistent_config_is_rejected_with_the_field_named(change, message):
    with pytest.raises(ValueError, match=message):
        Drama3Config(**(tiny_config_dict() | change))


# ----------------------------------------------------------------------------- published layout


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_published_checkpoint_loads_with_no_missing_or_unexpected_keys(tmp_path, fp8):
    model = tiny_model().to(torch.bfloat16)
    write_published_checkpoint(model, tmp_path, fp8=fp8)
    assert set(load_file(tmp_path / "model.safetensors")) == published_tensor_names(model.config, fp8=fp8)
    loaded, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert loaded.config.is_block_fp8 == fp8


def test_fp8_experts_dequantise_to_the_stored_blocks(tmp_path):
    model = tiny_model()
    write_published_checkpoint(model, tmp_path, fp8=True)
    stored = load_file(tmp_path / "model.safetensors")
    loaded = AutoModel.from_pretrained(tmp_path, dtype=torch.float32)
    experts = loaded.backbone.layers[1].mlp.experts
    name = "model.language_model.layers.1.mlp.experts.2.{}.weight"
    gate = dequantize_block_fp8(stored[name.format("gate_proj")], stored[name.format("gate_proj") + "_scale_inv"], dtype=torch.float32)
    up = dequantize_block_fp8(stored[name.format("up_proj")], stored[name.format("up_proj") + "_scale_inv"], dtype=torch.float32)
    down = dequantize_block_fp8(stored[name.format("down_proj")], stored[name.format("down_proj") + "_scale_inv"], dtype=torch.float32)
    torch.testing.assert_close(experts.gate_up_proj[2], torch.cat((gate, up)))
    torch.testing.assert_close(experts.down_proj[2], down)
    # ... and they stay within FP8 rounding (3 mantissa bits) of the float weights.
    original = model.backbone.layers[1].mlp.experts.gate_up_proj[2]
    assert ((experts.gate_up_proj[2] - original).abs() <= original.abs() / 16 + 1e-3).all()


def test_fp8_checkpoint_saves_back_byte_for_byte(tmp_path):
    write_published_checkpoint(tiny_model(), tmp_path / "a", fp8=True)
    AutoModel.from_pretrained(tmp_path / "a", dtype=torch.float32).save_pretrained(tmp_path / "b")
    first, second = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert set(first) == set(second)
    for name in first:
        assert first[name].dtype == second[name].dtype, name
        assert torch.equal(first[name].float(), second[name].float()), name
    assert json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"] == BLOCK_FP8


def test_save_load_gives_identical_outputs(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    input_ids, audio_codes = prompt_rows()
    with torch.no_grad():
        before, after = model(input_ids, audio_codes), loaded(input_ids, audio_codes)
    assert torch.equal(before.logits, after.logits)
    assert torch.equal(before.codebook_logits, after.codebook_logits)


# ----------------------------------------------------------------------------- equivalences


@pytest.mark.parametrize("backbone_codebooks", [0, 1, 3])
def test_cached_decode_equals_full_forward(backbone_codebooks):
    """Prefill + one decode step per frame (`decoding.step.draw`, then `feed`) gives the logits of a
    full forward over all rows."""
    from transformers_drama3.decoding.loop import DecodeRun

    model = tiny_model(tower={"vq_backbone_codebooks": backbone_codebooks})
    input_ids, audio_codes = prompt_rows()
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        run = DecodeRun.prefilled(model, input_ids, audio_codes, mask, KeepSpeaking(model), torch.tensor([5]))
        full = None
        for index, step in enumerate(run.steps()):
            if full is not None:  # the row drawn last step went through the backbone before this draw
                torch.testing.assert_close(run.state.hidden, full.last_hidden_state[:, -1:], rtol=1e-4, atol=1e-5)
            main, frame = step.main_ids[:, None], step.frames[:, None]
            input_ids, audio_codes = torch.cat((input_ids, main), 1), torch.cat((audio_codes, frame), 1)
            full = model(input_ids, audio_codes)
            # the frame drawn step by step is the argmax of the teacher-forced tower at that row
            assert torch.equal(full.codebook_logits[:, -2].argmax(-1), frame[:, 0, 1:])
        assert index == 4


class KeepSpeaking:
    """A greedy sampler that never draws eos (tests the audio path of every step)."""

    def __init__(self, model):
        self.candidate_ids = model.speech_token_ids()

    def main_token(self, logits, active=None):
        return self.candidate_ids[logits[:, -1, :-1].argmax(-1)][:, None]  # eos is the last candidate

    def codebook(self, logits, codebook_index):
        return logits[:, -1].argmax(-1, keepdim=True)

    def advance(self):
        pass


def test_left_padded_batch_equals_one_by_one():
    model = tiny_model()
    short_ids, short_codes = prompt_rows(seed=1, text=(9, 10), frames=2)
    long_ids, long_codes = prompt_rows(seed=2, text=(5, 6, 7, 8, 11), frames=5)
    pad = long_ids.shape[1] - short_ids.shape[1]
    batch_ids = torch.cat((F.pad(short_ids, (pad, 0)), long_ids))
    batch_codes = torch.cat((F.pad(short_codes, (0, 0, pad, 0)), long_codes))
    mask = torch.ones_like(batch_ids)
    mask[0, :pad] = 0
    with torch.no_grad():
        batched = model(batch_ids, batch_codes, attention_mask=mask)
        alone = [model(short_ids, short_codes), model(long_ids, long_codes)]
    torch.testing.assert_close(batched.logits[0, pad:], alone[0].logits[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(batched.logits[1], alone[1].logits[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(batched.codebook_logits[0, pad:], alone[0].codebook_logits[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(batched.codebook_logits[1], alone[1].codebook_logits[0], rtol=1e-4, atol=1e-5)


def test_restricted_logits_are_the_band_then_eos():
    model = tiny_model()
    input_ids, audio_codes = prompt_rows()
    with torch.no_grad():
        full, restricted = model(input_ids, audio_codes).logits, model(input_ids, audio_codes, restrict_logits=True).logits
    assert restricted.shape[-1] == CODEBOOK_SIZE + 1
    torch.testing.assert_close(restricted[..., :CODEBOOK_SIZE], full[..., SEMANTIC_START : SEMANTIC_START + CODEBOOK_SIZE])
    torch.testing.assert_close(restricted[..., -1], full[..., EOS])


def test_partial_codebook_fusion_matches_the_paper_formula():
    model = tiny_model(tower={"vq_backbone_codebooks": 2})
    input_ids, audio_codes = prompt_rows()
    embedded = model.embed_rows(input_ids, audio_codes)
    table, codebooks = model.backbone.embed_tokens.weight, model.audio_decoder.codebook_embeddings.weight
    t = 6  # an audio row
    expected = (
        table[input_ids[0, t]] + codebooks[CODEBOOK_SIZE + audio_codes[0, t, 1]] + codebooks[2 * CODEBOOK_SIZE + audio_codes[0, t, 2]]
    ) / 3**0.5
    torch.testing.assert_close(embedded[0, t], expected)
    torch.testing.assert_close(embedded[0, 0], table[input_ids[0, 0]])


def test_codebook_logits_do_not_see_the_future():
    model = tiny_model()
    input_ids, audio_codes = prompt_rows(frames=6)
    changed = audio_codes.clone()
    changed[0, -1] = (changed[0, -1] + 1) % CODEBOOK_SIZE
    with torch.no_grad():
        a, b = model(input_ids, audio_codes), model(input_ids, changed)
    # rows before the second-to-last neither read nor predict the last frame
    torch.testing.assert_close(a.codebook_logits[:, :-2], b.codebook_logits[:, :-2])
    assert not torch.allclose(a.codebook_logits[:, -2], b.codebook_logits[:, -2])


# ----------------------------------------------------------------------------- losses, gradients


def supervised_example():
    """System text, then a supervised take: 3 audio frames and <|im_end|>."""
    generator = torch.Generator().manual_seed(3)
    input_ids, audio_codes = make_rows([5, 6, 7], random_frames(3, generator), trailing_text=[EOS])
    labels = input_ids.clone()
    labels[0, :3] = -100  # text prompt rows are not supervised
    return input_ids, audio_codes, labels


def test_loss_terms_equal_hand_computed_cross_entropies():
    model = tiny_model()
    input_ids, audio_codes, labels = supervised_example()
    out = model(input_ids, audio_codes, labels=labels, output_router_logits=False)
    logits, codebook_logits = out.logits[0], out.codebook_logits[0]
    # rows 2, 3, 4 predict the three audio frames (rows 3, 4, 5); row 5 predicts <|im_end|> (row 6)
    semantic_rows, text_rows = [2, 3, 4], [5]
    l_sem = sum(F.cross_entropy(logits[t], input_ids[0, t + 1]) for t in semantic_rows) / 3
    l_text = F.cross_entropy(logits[5], input_ids[0, 6])
    l_cb = sum(
        F.cross_entropy(codebook_logits[t, k], audio_codes[0, t + 1, k + 1])
        for t in semantic_rows
        for k in range(NUM_CODEBOOKS - 1)
    ) / (3 * (NUM_CODEBOOKS - 1))
    torch.testing.assert_close(out.semantic_loss, l_sem)
    torch.testing.assert_close(out.text_loss, l_text)
    torch.testing.assert_close(out.codebook_loss, l_cb)
    torch.testing.assert_close(out.loss, l_text + 0.5 * l_sem + 0.5 * l_cb)
    assert text_rows == [5]


def test_a_codebook_loss_weighted_zero_leaves_the_tower_out():
    model = tiny_model().train()
    input_ids, audio_codes, labels = supervised_example()
    full = model(input_ids, audio_codes, labels=labels, output_router_logits=False)
    model.config.codebook_loss_weight = 0.0
    backbone_only = model(input_ids, audio_codes, labels=labels, output_router_logits=False)
    assert backbone_only.codebook_logits is None and backbone_only.codebook_loss is None
    torch.testing.assert_close(backbone_only.semantic_loss, full.semantic_loss)
    torch.testing.assert_close(backbone_only.loss, full.text_loss + 0.5 * full.semantic_loss)
    backbone_only.loss.backward()
    # the tower's layers and heads are idle (its codebook table, `audio_decoder`, also embeds the
    # backbone's input rows)
    tower = [*model.audio_decoder_mtp_shared.parameters(), *model.audio_decoder_mtp.parameters()]
    assert tower and all(p.grad is None for p in tower)
    assert model.lm_head.weight.grad.abs().sum() > 0
    # without labels (inference) the tower still runs
    assert model(input_ids, audio_codes).codebook_logits is not None


def test_router_load_balancing_loss_is_added_with_its_coefficient():
    model = tiny_model()
    input_ids, audio_codes, labels = supervised_example()
    plain = model(input_ids, audio_codes, labels=labels, output_router_logits=False)
    with_aux = model(input_ids, audio_codes, labels=labels, output_router_logits=True)
    coefficient = model.config.text_config.router_aux_loss_coef
    assert with_aux.aux_loss > 0
    torch.testing.assert_close(with_aux.loss, plain.loss + coefficient * with_aux.aux_loss)


def test_gradients_reach_every_trainable_parameter():
    model = tiny_model().train()
    input_ids, audio_codes, labels = supervised_example()
    model(input_ids, audio_codes, labels=labels, output_router_logits=True).loss.backward()
    # Codebook 0 has rows in the shared table but is never summed in (c0 enters as a token).
    unused = {"audio_decoder.codebook_embeddings.weight"}
    missing = [
        name for name, p in model.named_parameters() if name not in unused and (p.grad is None or not p.grad.abs().sum())
    ]
    # Routed experts that no row was sent to get no gradient; every other parameter must.
    missing = [name for name in missing if ".mlp.experts." not in name]
    assert not missing
    used_rows = model.audio_decoder.codebook_embeddings.weight.grad.abs().sum(-1).nonzero().flatten()
    assert (used_rows >= CODEBOOK_SIZE).all() and len(used_rows) > 0


def test_codebook_loss_reaches_the_backbone():
    model = tiny_model().train()
    input_ids, audio_codes, _ = supervised_example()
    out = model(input_ids, audio_codes)
    out.codebook_logits.sum().backward()
    assert model.backbone.layers[0].linear_attn.in_proj_qkv.weight.grad.abs().sum() > 0


def test_a_one_row_prompt_is_refused():
    from generation_helpers import GrowingCache

    model = tiny_model()
    cache = GrowingCache.empty(model.config)
    with pytest.raises(ValueError, match="at least 2 rows"):
        model.prefill(torch.tensor([[5]]), torch.zeros(1, 1, NUM_CODEBOOKS, dtype=torch.long), torch.ones(1, 1), cache)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_load_state_dict_accepts_the_published_file(tmp_path, fp8):
    """A published-layout file read directly (as Trainer does on resume) loads strictly."""
    model = tiny_model()
    write_published_checkpoint(model, tmp_path, fp8=fp8)
    fresh = tiny_model(seed=1)
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    expected = AutoModel.from_pretrained(tmp_path, dtype=torch.float32)
    for (name, a), b in zip(fresh.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(a, b), name


def test_row_weights_make_each_loss_term_a_weighted_mean():
    model = tiny_model()
    input_ids, audio_codes, labels = supervised_example()
    plain = model(input_ids, audio_codes, labels=labels, output_router_logits=False)
    ones = model(input_ids, audio_codes, labels=labels, row_weights=torch.ones(labels.shape), output_router_logits=False)
    torch.testing.assert_close(ones.loss, plain.loss)
    # Weight 3 on the frame that row 3 is labelled with (row 4): its terms count three times.
    weights = torch.ones(labels.shape)
    weights[0, 4] = 3.0
    weighted = model(input_ids, audio_codes, labels=labels, row_weights=weights, output_router_logits=False)
    logits, codebook_logits = plain.logits[0], plain.codebook_logits[0]
    nll = {t: F.cross_entropy(logits[t], input_ids[0, t + 1]) for t in (2, 3, 4)}
    torch.testing.assert_close(weighted.semantic_loss, (nll[2] + 3 * nll[3] + nll[4]) / 5)
    cb = {t: F.cross_entropy(codebook_logits[t], audio_codes[0, t + 1, 1:]) for t in (2, 3, 4)}
    torch.testing.assert_close(weighted.codebook_loss, (cb[2] + 3 * cb[3] + cb[4]) / 5)
    torch.testing.assert_close(weighted.text_loss, plain.text_loss)

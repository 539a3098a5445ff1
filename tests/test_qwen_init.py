"""Initialising Drama 3 from a Qwen3.5-MoE checkpoint (issue 2, point 6), on tiny checkpoints the
tests write with transformers in each layout a Qwen3.5-MoE checkpoint can have."""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from transformers_drama3 import Drama3ForSpeechGeneration
from transformers_drama3.runtime.qwen_init import drama3_config_from_qwen, init_from_qwen3_5_moe, main

QWEN_VOCAB = 96
CODEBOOK_SIZE = 32
EOS = 2
TOWER = dict(dim=64, n_head=4, n_local_heads=2, head_dim=16, intermediate_size=96, num_codebooks=4,
             shared_enrichment_layers=2)


def tiny_qwen() -> Qwen3_5MoeForCausalLM:
    config = Qwen3_5MoeTextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=QWEN_VOCAB, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(config).eval()
    with torch.no_grad():  # zero-initialised norms would hide a mix-up of norm weights
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0, 0.1)
    return model


def drama3_config(qwen: Qwen3_5MoeForCausalLM):
    return drama3_config_from_qwen(
        qwen.config, eos_token_id=EOS, codebook_size=CODEBOOK_SIZE, audio_decoder_config=dict(TOWER)
    )


def to_vision_language_layout(directory, fuse_experts: bool) -> None:
    """Rewrite a text-only save as the published Qwen3.5-MoE release: `model.language_model.*`,
    a vision-language config, and vision / MTP tensors that Drama 3 drops."""
    path = directory / "model.safetensors"
    tensors = {re.sub(r"^model\.", "model.language_model.", key): value for key, value in load_file(path).items()}
    if fuse_experts:
        tensors = fused_experts(tensors)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(3, 3)
    tensors["mtp.fc.weight"] = torch.ones(3, 3)
    save_file(tensors, path, metadata={"format": "pt"})
    text_config = Qwen3_5MoeTextConfig.from_pretrained(directory).to_dict()
    (directory / "config.json").unlink()
    Qwen3_5MoeConfig(text_config=text_config).save_pretrained(directory)


def fused_experts(tensors: dict) -> dict:
    """Per-expert `experts.E.{gate,up,down}_proj.weight` -> `experts.gate_up_proj` / `experts.down_proj`."""
    per_expert = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    fused = {key: value for key, value in tensors.items() if not per_expert.match(key)}
    groups = {}
    for key, value in tensors.items():
        if match := per_expert.match(key):
            groups.setdefault(match[1], {})[(int(match[2]), match[3])] = value
    for prefix, weights in groups.items():
        experts = range(max(index for index, _ in weights) + 1)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat((weights[e, "gate"], weights[e, "up"])) for e in experts]
        )
        fused[f"{prefix}.down_proj"] = torch.stack([weights[e, "down"] for e in experts])
    return fused


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen()


@pytest.fixture(scope="module")
def checkpoints(qwen, tmp_path_factory):
    """The same Qwen weights saved as: a text-only save (`model.*`, per-expert), the published
    vision-language layout per-expert, and the same with fused experts."""
    root = tmp_path_factory.mktemp("qwen")
    paths = {}
    for layout in ("text_only", "per_expert", "fused"):
        paths[layout] = root / layout
        qwen.save_pretrained(paths[layout])
        if layout != "text_only":
            to_vision_language_layout(paths[layout], fuse_experts=layout == "fused")
    return paths


@pytest.fixture(scope="module")
def drama(qwen, checkpoints):
    return init_from_qwen3_5_moe(checkpoints["per_expert"], drama3_config(qwen))


def text_ids() -> torch.Tensor:
    return torch.randint(0, QWEN_VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def test_text_only_input_gives_qwens_hidden_states_and_logits(qwen, drama):
    ids = text_ids()
    with torch.no_grad():
        expected_hidden = qwen.model(input_ids=ids).last_hidden_state
        expected_logits = qwen(input_ids=ids).logits
        output = drama(input_ids=ids)
    # two module trees computing the same function: equal to float32 rounding, not bitwise
    torch.testing.assert_close(output.last_hidden_state, expected_hidden)
    torch.testing.assert_close(output.logits[..., :QWEN_VOCAB], expected_logits)


@pytest.mark.parametrize("layout", ["text_only", "fused"])
def test_every_checkpoint_layout_gives_the_same_model(qwen, drama, checkpoints, layout):
    other = init_from_qwen3_5_moe(checkpoints[layout], drama3_config(qwen))
    expected = drama.state_dict()
    assert other.state_dict().keys() == expected.keys()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in other.state_dict().items())


def test_a_published_layout_state_dict_gives_the_same_model(qwen, drama, checkpoints):
    state_dict = load_file(checkpoints["per_expert"] / "model.safetensors")
    other = init_from_qwen3_5_moe(state_dict, drama3_config(qwen))
    assert all(torch.equal(tensor, drama.state_dict()[name]) for name, tensor in other.state_dict().items())


def test_semantic_rows_are_added_to_embeddings_and_lm_head(qwen, drama):
    config = drama.config
    assert config.semantic_start_token_id == QWEN_VOCAB
    assert config.semantic_end_token_id == QWEN_VOCAB + CODEBOOK_SIZE - 1
    for table, qwen_table in (
        (drama.get_input_embeddings().weight, qwen.model.embed_tokens.weight),
        (drama.lm_head.weight, qwen.lm_head.weight),
    ):
        assert table.shape == (QWEN_VOCAB + CODEBOOK_SIZE, 64)
        assert torch.equal(table[:QWEN_VOCAB], qwen_table)
        new, mean, std = table[QWEN_VOCAB:], qwen_table.mean(0), qwen_table.std(0)
        assert torch.all((new - mean).abs() <= 0.01 * std * 6)  # mean + noise of 0.01 x Qwen's spread
        assert torch.unique(new, dim=0).shape[0] == CODEBOOK_SIZE  # no two semantic rows alike


def test_tower_is_freshly_initialised(drama):
    tower = dict(drama.named_parameters())
    assert tower["audio_decoder.codebook_embeddings.weight"].shape == (4 * CODEBOOK_SIZE, 64)
    assert tower["audio_decoder.codebook_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.2)
    assert torch.all(tower["audio_decoder_mtp.layers.0.final_layernorm.weight"] == 0)  # zero-centred norm
    assert all(torch.isfinite(p).all() for n, p in tower.items() if n.startswith("audio_decoder"))


def test_speech_rows_run_after_initialisation(drama):
    ids = torch.tensor([[5, 7, QWEN_VOCAB + 3, QWEN_VOCAB + 31]])
    codes = torch.zeros(1, 4, 4, dtype=torch.long)
    codes[0, 2:] = torch.tensor([[3, 1, 2, 3], [31, 0, 5, 9]])
    with torch.no_grad():
        output = drama(input_ids=ids, audio_codes=codes)
    assert output.codebook_logits.shape == (1, 4, 3, CODEBOOK_SIZE)
    assert torch.isfinite(output.codebook_logits).all()


def test_every_parameter_is_trainable(drama):
    assert all(parameter.requires_grad for parameter in drama.parameters())


def test_a_config_that_differs_from_qwens_architecture_is_refused(qwen, checkpoints):
    config = drama3_config(qwen)
    config.text_config.num_experts_per_tok = 1
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        init_from_qwen3_5_moe(checkpoints["per_expert"], config)


def test_cli_saves_a_model_that_loads_with_qwens_hidden_states(qwen, checkpoints, tmp_path):
    qwen_dir = checkpoints["per_expert"]
    (qwen_dir / "tokenizer.json").write_text('{"added_tokens": [{"id": 2, "content": "<|im_end|>"}]}')
    out = tmp_path / "drama3"
    main([str(qwen_dir), str(out), "--dtype", "float32"])
    # The CLI adds the full 4096-token band and the default tower.
    loaded = Drama3ForSpeechGeneration.from_pretrained(out, dtype=torch.float32)
    assert loaded.config.eos_token_id == EOS
    assert loaded.config.text_config.vocab_size == QWEN_VOCAB + 4096
    ids = text_ids()
    with torch.no_grad():
        expected = qwen.model(input_ids=ids).last_hidden_state
        torch.testing.assert_close(loaded(input_ids=ids).last_hidden_state, expected)  # float32 rounding, two paths

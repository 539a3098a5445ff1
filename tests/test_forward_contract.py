"""The forward contract every transformers model keeps, on Drama 3's two heads and its base model:
`return_dict`, `output_hidden_states`, `output_attentions`, `use_cache` / `cache`, `inputs_embeds`,
padding-free batches, `Drama3Model` as `base_model` (save, load, base/head interchange), and a
config that builds on any vocabulary with its ids refused where they are used.

transformers' own battery (tests/test_transformers_battery.py) checks the same contract by its
generic rules; these tests check the numbers: each output against the path it must equal.
"""

import pytest
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from generation_helpers import prompt
from model_helpers import SEMANTIC_START, tiny_config, tiny_model
from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration
from transformers_drama3.modeling_drama3 import Drama3Model, positions_from_mask
from transformers_drama3.modeling_drama3_reward import Drama3ForRewardModeling

FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}


def rows(seed: int = 0, batch: int = 2):
    """A left-padded batch: input_ids [batch, rows], audio_codes [batch, rows, C], attention_mask."""
    items = [prompt(seed + item) for item in range(batch)]
    ids, codes = items[0][0][None].repeat(batch, 1), items[0][1][None].repeat(batch, 1, 1)
    for item, (item_ids, item_codes) in enumerate(items):
        ids[item], codes[item] = item_ids, item_codes
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, codes, mask


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


@pytest.fixture(scope="module")
def reward():
    torch.manual_seed(2)
    return Drama3ForRewardModeling(tiny_config()).eval()


# ---- outputs -------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("head", ["model", "reward"])
def test_return_dict_false_gives_the_dicts_fields_as_a_tuple(head, request):
    model = request.getfixturevalue(head)
    ids, codes, mask = rows()
    kwargs = {"input_ids": ids, "audio_codes": codes, "attention_mask": mask, "output_hidden_states": True}
    as_dict = model(**kwargs)
    as_tuple = model(**kwargs, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(as_dict.to_tuple())
    for mine, theirs in zip(as_tuple, as_dict.to_tuple()):
        if isinstance(mine, torch.Tensor):
            assert torch.equal(mine, theirs)
        else:
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


@torch.no_grad()
def test_hidden_states_are_the_embedded_rows_then_each_layers_output(model):
    ids, codes, mask = rows()
    layers = model.backbone.layers
    captured = []
    hooks = [layer.register_forward_hook(lambda module, args, output: captured.append(output)) for layer in layers]
    try:
        out = model(ids, codes, attention_mask=mask, output_hidden_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(out.hidden_states) == len(layers) + 1
    torch.testing.assert_close(out.hidden_states[0], model.embed_rows(ids, codes), rtol=0, atol=0)
    for index in range(len(layers) - 1):
        torch.testing.assert_close(out.hidden_states[index + 1], captured[index], rtol=0, atol=0)
    # the last one after the final norm, as in transformers' Qwen3.5-MoE
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(out.hidden_states[-1], model.backbone.norm(captured[-1]), rtol=0, atol=0)
    assert model(ids, codes, attention_mask=mask).hidden_states is None


@torch.no_grad()
def test_attentions_are_the_full_attention_layers_causal_weights_over_real_rows():
    model = tiny_model(seed=1)
    model.set_attn_implementation("eager")
    ids, codes, mask = rows()
    out = model(ids, codes, attention_mask=mask, output_attentions=True)
    full = model.config.text_config.layer_types.count("full_attention")
    assert len(out.attentions) == full
    batch, length = ids.shape
    for weights in out.attentions:
        assert weights.shape == (batch, model.config.text_config.num_attention_heads, length, length)
        future = torch.ones(length, length).triu(1).bool()
        assert (weights[1][:, future] == 0).all() and (weights[0, :, 3:][:, future[3:]] == 0).all()
        assert (weights[0, :, 3:, :3] == 0).all()  # the left padding of item 0 is never attended to
        torch.testing.assert_close(weights[0, :, 3:].sum(-1), torch.ones(weights.shape[1], length - 3))
    # the attention implementation changes only how they are computed (padding rows are no output)
    real = mask.bool()
    eager_logits = out.logits[real]
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(model(ids, codes, attention_mask=mask).logits[real], eager_logits, **FLOAT32)


# ---- cache ---------------------------------------------------------------------------------------


@torch.no_grad()
def test_a_forward_continued_from_its_cache_gives_the_full_forwards_logits(model):
    ids, codes, mask = rows()
    full = model(ids, codes, attention_mask=mask)
    first = model(ids[:, :9], codes[:, :9], attention_mask=mask[:, :9], use_cache=True)
    assert isinstance(first.cache, DynamicCache) and int(first.cache.get_seq_length()) == 9
    torch.testing.assert_close(first.codebook_logits, full.codebook_logits[:, :9], **FLOAT32)
    rest = model(ids[:, 9:], codes[:, 9:], attention_mask=mask, cache=first.cache, use_cache=True)
    torch.testing.assert_close(rest.logits, full.logits[:, 9:], **FLOAT32)
    assert rest.codebook_logits is None  # the tower's own states are not in the backbone's cache
    assert int(rest.cache.get_seq_length()) == ids.shape[1]
    assert model(ids, codes, attention_mask=mask).cache is None


@torch.no_grad()
def test_the_older_cache_name_past_key_values_is_taken(model):
    ids, codes, mask = rows()
    cache_a = model(ids[:, :9], codes[:, :9], attention_mask=mask[:, :9], use_cache=True).cache
    cache_b = model(ids[:, :9], codes[:, :9], attention_mask=mask[:, :9], use_cache=True).cache
    new = model(ids[:, 9:], codes[:, 9:], attention_mask=mask, cache=cache_a)
    old = model(ids[:, 9:], codes[:, 9:], attention_mask=mask, past_key_values=cache_b)
    torch.testing.assert_close(old.logits, new.logits, rtol=0, atol=0)


@torch.no_grad()
def test_the_reward_model_continues_from_its_cache(reward):
    ids, codes, mask = rows()
    full = reward(ids, codes, attention_mask=mask)
    first = reward(ids[:, :9], codes[:, :9], attention_mask=mask[:, :9], use_cache=True)
    rest = reward(ids[:, 9:], codes[:, 9:], attention_mask=mask, cache=first.cache)
    torch.testing.assert_close(rest.logits, full.logits, **FLOAT32)


def test_a_loss_needs_whole_rows_and_their_ids(model):
    ids, codes, mask = rows()
    cache = model(ids[:, :9], codes[:, :9], attention_mask=mask[:, :9], use_cache=True).cache
    with pytest.raises(ValueError, match="labels need whole rows; the cache already holds 9 rows"):
        model(ids[:, 9:], codes[:, 9:], attention_mask=mask, cache=cache, labels=ids[:, 9:])
    with pytest.raises(ValueError, match="labels need input_ids"):
        model(inputs_embeds=model.embed_rows(ids, codes), labels=ids)


# ---- inputs --------------------------------------------------------------------------------------


@torch.no_grad()
def test_inputs_embeds_of_the_fused_rows_give_the_ids_outputs(model):
    ids, codes, mask = rows()
    expected = model(ids, codes, attention_mask=mask)
    embeds = model.embed_rows(ids, codes)
    alone = model(inputs_embeds=embeds, attention_mask=mask)
    torch.testing.assert_close(alone.logits, expected.logits, rtol=0, atol=0)
    assert alone.codebook_logits is None  # without ids the rows' kinds are unknown: no tower
    labelled = model(input_ids=ids, audio_codes=codes, inputs_embeds=embeds, attention_mask=mask)
    torch.testing.assert_close(labelled.codebook_logits, expected.codebook_logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match=rf"inputs_embeds has shape \(2, {ids.shape[1]}, 8\); expected \[batch, rows, hidden\]"):
        model(inputs_embeds=embeds[..., :8])


@torch.no_grad()
def test_a_padding_free_batch_by_restarting_positions_equals_each_document_alone(model):
    documents = [prompt(seed) for seed in (3, 4, 5)]
    ids = torch.cat([d[0] for d in documents])[None]
    codes = torch.cat([d[1] for d in documents])[None]
    positions = torch.cat([torch.arange(d[0].shape[0]) for d in documents])[None]
    packed = model(ids, codes, position_ids=positions)
    start = 0
    for doc_ids, doc_codes in documents:
        alone = model(doc_ids[None], doc_codes[None])
        end = start + doc_ids.shape[0]
        torch.testing.assert_close(packed.logits[:, start:end], alone.logits, **FLOAT32)
        # the last row of a document predicts no frame of the next one
        torch.testing.assert_close(packed.codebook_logits[:, start : end - 1], alone.codebook_logits[:, :-1], **FLOAT32)
        start = end


def test_a_4d_attention_mask_is_refused_by_name(model):
    ids, codes, _ = rows()
    length = ids.shape[1]
    mask = torch.ones(2, 1, length, length)
    with pytest.raises(ValueError, match=rf"attention_mask has shape \(2, 1, {length}, {length}\).*Gated DeltaNet layers are recurrent"):
        model(ids, codes, attention_mask=mask)


# ---- the base model ------------------------------------------------------------------------------


def test_base_model_is_a_pretrained_drama3_model_holding_the_backbone(model, reward):
    for head in (model, reward):
        assert isinstance(head.base_model, Drama3Model) and isinstance(head.base_model, PreTrainedModel)
        assert head.base_model.language_model is head.backbone
        assert head.get_input_embeddings() is head.base_model.get_input_embeddings() is head.backbone.embed_tokens


@torch.no_grad()
def test_the_base_models_forward_is_the_heads_backbone(model):
    ids, codes, mask = rows()
    head = model(ids, codes, attention_mask=mask, output_hidden_states=True)
    base = model.base_model(
        inputs_embeds=model.embed_rows(ids, codes), attention_mask=mask, position_ids=positions_from_mask(mask),
        output_hidden_states=True,
    )
    torch.testing.assert_close(base.last_hidden_state, head.last_hidden_state, **FLOAT32)
    assert len(base.hidden_states) == len(head.hidden_states)
    assert isinstance(model.base_model(ids, return_dict=False), tuple)


@torch.no_grad()
def test_base_and_head_checkpoints_load_into_each_other(model, tmp_path):
    model.base_model.save_pretrained(tmp_path / "base")
    base = Drama3Model.from_pretrained(tmp_path / "base")
    for name, tensor in model.base_model.state_dict().items():
        assert torch.equal(base.state_dict()[name], tensor), name
    head, info = Drama3ForSpeechGeneration.from_pretrained(tmp_path / "base", output_loading_info=True)
    assert all(not key.startswith("model.") for key in info["missing_keys"]) and "lm_head.weight" in info["missing_keys"]
    assert torch.equal(head.backbone.embed_tokens.weight, model.backbone.embed_tokens.weight)

    model.save_pretrained(tmp_path / "head")
    base, info = Drama3Model.from_pretrained(tmp_path / "head", output_loading_info=True)
    assert not info["missing_keys"]
    for name, tensor in model.base_model.state_dict().items():
        assert torch.equal(base.state_dict()[name], tensor), name


def test_the_backbone_is_initialised_as_transformers_qwen3_5_moe_text_model():
    """The backbone's class only declares capabilities: its weights from a seed are those of
    transformers' own class (the routers included, which a custom-code init would leave at zero)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel

    text_config = tiny_config().text_config
    torch.manual_seed(0)
    ours = Drama3Model(tiny_config()).language_model.state_dict()
    torch.manual_seed(0)
    theirs = Qwen3_5MoeTextModel(text_config).state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert ours["layers.0.mlp.gate.weight"].abs().sum() > 0


# ---- the config's ids ----------------------------------------------------------------------------


def test_the_config_builds_from_its_defaults_on_a_small_vocabulary():
    config = Drama3Config(text_config={"vocab_size": 100, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]})
    assert config.eos_token_id >= 100 and config.semantic_start_token_id >= 100


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"eos_token_id": 500}, r"eos_token_id=500 is outside the text vocabulary of 104"),
        ({"semantic_start_token_id": 90, "semantic_end_token_id": 121}, r"the semantic band \[90, 121\] .* outside the text vocabulary of 104"),
    ],
)
def test_ids_outside_the_vocabulary_are_refused_where_the_speech_logits_read_them(overrides, message):
    model = Drama3ForSpeechGeneration(tiny_config(**overrides)).eval()
    ids, codes, mask = rows()
    with torch.no_grad():
        model(ids.clamp(max=63), codes, attention_mask=mask)  # a teacher-forced forward reads no band rows
    with pytest.raises(ValueError, match=message):
        model.speech_logits(torch.zeros(1, model.config.hidden_size))
    with pytest.raises(ValueError, match=message):
        model.speech_token_ids()


def test_an_eos_inside_the_semantic_band_is_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match=f"eos_token_id={SEMANTIC_START + 1} lies inside the semantic band"):
        tiny_config(eos_token_id=SEMANTIC_START + 1)

"""Attention implementations switched as on any transformers model: `attn_implementation=` at
loading and `set_attn_implementation` after it. They apply to the backbone's full-attention layers;
eager, sdpa and flex_attention give the same speech outputs within float32 tolerance (flex compiles
its kernel on first use: one forward of one shape here). flash_attention_2 is declared and refused
by transformers, naming the missing package, where it is not installed."""

import importlib.util

import pytest
import torch

from generation_helpers import left_pad, prompt
from model_helpers import tiny_model
from transformers_drama3 import Drama3ForSpeechGeneration

FLOAT32 = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("attention")
    tiny_model(seed=4).save_pretrained(folder)
    return folder


def implementations(model) -> set[str]:
    return {model.config._attn_implementation, model.backbone.config._attn_implementation}


@torch.no_grad()
def test_eager_sdpa_and_flex_give_the_same_speech_outputs_after_loading(checkpoint):
    ids, codes, mask = left_pad([prompt(1), prompt(2, text_rows=3)])
    model = Drama3ForSpeechGeneration.from_pretrained(checkpoint, attn_implementation="eager").eval()
    assert implementations(model) == {"eager"}
    expected = model(ids, codes, attention_mask=mask)
    real = mask.bool()
    for implementation in ("sdpa", "flex_attention"):
        model.set_attn_implementation(implementation)
        assert implementations(model) == {implementation}
        got = model(ids, codes, attention_mask=mask)
        torch.testing.assert_close(got.logits[real], expected.logits[real], **FLOAT32)
        # a padding row labels nothing: the tower's outputs of real rows are the ones to compare
        torch.testing.assert_close(got.codebook_logits[real], expected.codebook_logits[real], **FLOAT32)


def test_an_unknown_implementation_is_refused_and_the_model_keeps_its_own(checkpoint):
    model = Drama3ForSpeechGeneration.from_pretrained(checkpoint, attn_implementation="sdpa")
    with pytest.raises(ValueError, match='attn_implementation="foo"'):
        model.set_attn_implementation("foo")
    assert implementations(model) == {"sdpa"}


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_2_is_declared_and_refused_without_its_package(checkpoint):
    assert Drama3ForSpeechGeneration._supports_flash_attn
    model = Drama3ForSpeechGeneration.from_pretrained(checkpoint)
    with pytest.raises(ImportError, match="FlashAttention2.*package"):
        model.set_attn_implementation("flash_attention_2")
    with pytest.raises(ImportError, match="FlashAttention2.*package"):
        Drama3ForSpeechGeneration.from_pretrained(checkpoint, attn_implementation="flash_attention_2")

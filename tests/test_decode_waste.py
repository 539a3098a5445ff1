"""What one decode step no longer repeats: a copy of the restricted lm_head rows, per-layer casts."""

import collections

import torch
from generation_helpers import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from transformers_drama3.kernels.fused_step import filtered_probabilities, top_k_filtered_probabilities
from transformers_drama3.modeling_drama3 import tower_attention_mask


def gathered_speech_logits(model, hidden):
    """The plain reference: gather the semantic band + eos rows of lm_head, then one product."""
    return torch.nn.functional.linear(hidden, model.lm_head.weight[model.speech_token_ids(hidden.device)])


def test_speech_logits_equal_the_gathered_rows_product():
    model = tiny_model(seed=0)
    hidden = torch.randn(3, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model.speech_logits(hidden), gathered_speech_logits(model, hidden))


def test_speech_logits_follow_a_weight_changed_in_place():
    model = tiny_model(seed=0)
    hidden = torch.randn(2, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    before = model.speech_logits(hidden)
    with torch.no_grad():
        model.lm_head.weight.data.mul_(-2.0)  # what a merge writing through `.data` does
    after = model.speech_logits(hidden)
    torch.testing.assert_close(after, gathered_speech_logits(model, hidden))
    torch.testing.assert_close(after, -2.0 * before)


def test_speech_logits_follow_weights_loaded_from_another_model():
    model, other = tiny_model(seed=0), tiny_model(seed=5)
    hidden = torch.randn(2, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    model.speech_logits(hidden)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(model.speech_logits(hidden), gathered_speech_logits(other, hidden))


class CastCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def tower_step_casts(model) -> int:
    """dtype casts (`_to_copy`) of one float32 draw (main token + the tower) after a 4-row prefill."""
    from transformers_drama3.decoding import step as decode_step
    from transformers_drama3.decoding.loop import DecodeRun
    from transformers_drama3.decoding.sampler import Drama3Sampler, SamplingSettings, prompt_window

    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(4, model.config.semantic_start_token_id, (1, 4), generator=generator)
    codes = torch.zeros(1, 4, model.config.num_codebooks, dtype=torch.long)
    mask = torch.ones_like(ids)
    sampler = Drama3Sampler(SamplingSettings(do_sample=False), model.speech_token_ids(), prompt_window(ids, mask))
    with torch.no_grad():
        run = DecodeRun.prefilled(model, ids, codes, mask, sampler, torch.tensor([4]))
        run.cache.open_window(run.cache.tower_part, 1)
        counter = CastCounter()
        with counter:
            decode_step.draw(model, run.cache, sampler, run.state, None)
    return counter.ops[torch.ops.aten._to_copy]


def test_a_tower_step_casts_once_per_step_not_once_per_layer():
    shallow = tiny_model(seed=0, tower={"shared_enrichment_layers": 1, "n_layer": 1})
    deep = tiny_model(seed=0, tower={"shared_enrichment_layers": 4, "n_layer": 4})
    assert tower_step_casts(deep) == tower_step_casts(shallow)


def test_a_capped_draw_sorting_only_its_top_k_gives_the_full_sorts_distribution():
    logits = torch.randn(5, 4096, generator=torch.Generator().manual_seed(6)) * 4
    for temperature, top_k, top_p, keep_crossing in ((1.0, 30, 0.9, False), (0.7, 30, 0.7, True), (1.0, 3, 1.0, False)):
        fast = top_k_filtered_probabilities(logits, temperature, top_k, top_p, keep_crossing)
        reference = filtered_probabilities(logits, temperature, top_k, top_p, keep_crossing)
        # the same softmax, and the same cumulative sum over the same top_k sorted values: bitwise
        assert torch.equal(fast > 0, reference > 0)
        torch.testing.assert_close(fast, reference)

"""A tag token added to the text vocabulary for fine-tuning, end to end: the tokenizer learns it,
`resize_token_embeddings` grows the embedding and the LM head with it, the speech outputs of a
prompt without it are unchanged (the semantic band and eos keep their rows), a training step
reaches its new rows, and the resized model and processor save and load."""

import pytest
import torch

from generation_helpers import BUNDLE_CODEBOOK_SIZE, tiny_speech_bundle
from transformers_drama3 import Drama3ForSpeechGeneration, Drama3Processor
from transformers_drama3.modeling_drama3_reward import Drama3ForRewardModeling
from transformers_drama3.prompting import Script

TAG = "[whisper]"  # a bracket tag, as scripts write them, made one token


def target(frames: int, seed: int) -> torch.Tensor:
    """Codes [codebooks, frames] of a take in the bundle's codebook."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, BUNDLE_CODEBOOK_SIZE, (4, frames), generator=generator)


@pytest.fixture(scope="module")
def tagged():
    """(model before the tag, model and processor after it)."""
    model, processor = tiny_speech_bundle(seed=5)
    before = tiny_speech_bundle(seed=5)[0]
    processor.tokenizer.add_tokens([TAG])
    model.resize_token_embeddings(len(processor.tokenizer))
    return before, model, processor


def test_the_tag_is_one_new_id_and_the_model_grows_by_it(tagged):
    before, model, processor = tagged
    tag_id = processor.tokenizer.convert_tokens_to_ids(TAG)
    old_vocab = before.config.text_config.vocab_size
    assert tag_id == old_vocab == len(processor.tokenizer) - 1
    assert model.config.text_config.vocab_size == old_vocab + 1
    assert model.get_input_embeddings().weight.shape[0] == model.lm_head.weight.shape[0] == old_vocab + 1
    ids = processor(Script(f"{TAG} Hello there."))["input_ids"][0].tolist()
    assert ids.count(tag_id) == 1


@torch.no_grad()
def test_a_prompt_without_the_tag_speaks_as_before(tagged):
    before, model, processor = tagged
    batch = processor(Script("Hello there.", target=target(3, seed=1)))
    old = before(batch["input_ids"], batch["audio_codes"], attention_mask=batch["attention_mask"])
    new = model(batch["input_ids"], batch["audio_codes"], attention_mask=batch["attention_mask"])
    old_vocab = before.config.text_config.vocab_size
    torch.testing.assert_close(new.logits[..., :old_vocab], old.logits, rtol=0, atol=0)
    torch.testing.assert_close(new.codebook_logits, old.codebook_logits, rtol=0, atol=0)
    torch.testing.assert_close(model.speech_logits(new.last_hidden_state), before.speech_logits(old.last_hidden_state), rtol=0, atol=0)
    assert torch.equal(model.speech_token_ids(), before.speech_token_ids())


def test_a_training_step_on_a_tagged_take_reaches_the_new_rows(tagged):
    _, model, processor = tagged
    tag_id = processor.tokenizer.convert_tokens_to_ids(TAG)
    batch = processor(Script(f"{TAG} Hello there.", target=target(3, seed=2)))
    model.train()
    try:
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
    finally:
        model.eval()
    assert torch.isfinite(loss)
    assert model.get_input_embeddings().weight.grad[tag_id].abs().sum() > 0  # the tag is read
    assert model.lm_head.weight.grad[tag_id].abs().sum() > 0  # and its logit is pushed down as a wrong next token
    model.zero_grad()


@torch.no_grad()
def test_the_resized_model_and_processor_save_and_load(tagged, tmp_path):
    _, model, processor = tagged
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = Drama3ForSpeechGeneration.from_pretrained(tmp_path).eval()
    reloaded_processor = Drama3Processor.from_pretrained(tmp_path)
    assert reloaded_processor.tokenizer.convert_tokens_to_ids(TAG) == processor.tokenizer.convert_tokens_to_ids(TAG)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    batch = reloaded_processor(Script(f"{TAG} Hello there."))
    torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)


def test_the_reward_model_resizes_its_embedding(tagged):
    before, _, processor = tagged
    reward = Drama3ForRewardModeling(before.config)
    reward.resize_token_embeddings(len(processor.tokenizer))
    assert reward.get_input_embeddings().weight.shape[0] == len(processor.tokenizer)
    assert reward.get_output_embeddings() is None  # a score head, not an LM head
    batch = processor(Script(f"{TAG} Hello there."))
    with torch.no_grad():
        assert reward(batch["input_ids"], batch["audio_codes"], attention_mask=batch["attention_mask"]).logits.shape == (1, 1)

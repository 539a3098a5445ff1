"""Drama3Processor as a transformers processor, without a codec: chat conversations, saving and
loading (Auto classes, tokenizer files), writing audio files."""

import json

import numpy as np
import pytest
import torch

from processor_helpers import random_codes, tiny_processor
from transformers_drama3.processing_drama3 import Drama3Processor, conversation_to_script
from transformers_drama3.prompting import Line, Reference, Script, Take
from transformers_drama3.prompting.tokenizer_build import build_drama3_tokenizer


# ---- conversations --------------------------------------------------------------------------------------------


def test_chat_with_speaker_roles_gives_the_rows_of_the_script():
    processor = tiny_processor()
    a, b = random_codes(3, seed=1), random_codes(2, seed=2)
    conversation = [
        {"role": "0", "content": [{"type": "text", "text": "First voice."}, {"type": "audio", "codes": a}]},
        {"role": "1", "content": [{"type": "text", "text": "Second voice."}, {"type": "audio", "codes": b}]},
        {"role": "0", "content": [{"type": "text", "text": "Where were you?"}]},
        {"role": "1", "content": "Out."},
    ]
    script = Script(
        [Line("Where were you?", 0), Line("Out.", 1)],
        references=[Reference("First voice.", a, 0), Reference("Second voice.", b, 1)],
    )
    chat = processor.apply_chat_template(conversation, tokenize=True, return_dict=True, add_generation_prompt=True)
    rows = processor(script)
    for key in ("input_ids", "audio_codes", "attention_mask"):
        assert torch.equal(chat[key], rows[key])


def test_chat_with_system_references_user_text_and_history_gives_the_rows_of_the_script():
    processor = tiny_processor()
    ref, take = random_codes(3, seed=1), random_codes(4, seed=2)
    conversation = [
        {
            "role": "system",
            "content": [{"type": "text", "text": "Reference words."}, {"type": "audio", "codes": ref, "speaker": 1}],
        },
        {"role": "user", "content": [{"type": "text", "text": "<|speaker:1|>Take one."}]},
        {"role": "assistant", "content": [{"type": "audio", "codes": take}]},
        {"role": "user", "content": "<|speaker:1|>[softer than the previous take] Take one."},
    ]
    # raw text is spoken as given: the equivalent script gives the same raw text, and its
    # instruction lands where the conversation wrote it (after the speaker tag)
    script = Script(
        "<|speaker:1|>Take one.",
        references=[Reference("Reference words.", ref, 1)],
        history=[Take("<|speaker:1|>Take one.", take)],
        instruction="softer than the previous take",
    )
    assert torch.equal(processor.apply_chat_template(conversation)["input_ids"], processor(script)["input_ids"])


def test_chat_user_text_with_audio_is_a_reference():
    processor = tiny_processor()
    ref = random_codes(3, seed=1)
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Ref words."}, {"type": "audio", "codes": ref}]},
        {"role": "user", "content": [{"type": "text", "text": "Now say this."}]},
    ]
    rows = processor("Now say this.", reference_audio=ref, reference_text="Ref words.")
    assert torch.equal(processor.apply_chat_template(conversation)["input_ids"], rows["input_ids"])


def test_chat_ending_with_an_assistant_take_is_a_training_example():
    processor = tiny_processor()
    target = random_codes(3, seed=1)
    conversation = [
        {"role": "user", "content": "Say it."},
        {"role": "assistant", "content": [{"type": "audio", "codes": target}]},
    ]
    chat = processor.apply_chat_template(conversation)
    rows = processor(Script("Say it.", target=target))
    assert torch.equal(chat["input_ids"], rows["input_ids"]) and torch.equal(chat["labels"], rows["labels"])


def test_chat_batches_and_text_rendering():
    processor = tiny_processor()
    conversations = [[{"role": "user", "content": "One."}], [{"role": "user", "content": "Two, longer."}]]
    batch = processor.apply_chat_template(conversations)
    assert batch["input_ids"].shape[0] == 2
    text = processor.apply_chat_template(conversations[0], tokenize=False)
    assert text.endswith("<|im_start|>user\n<|speaker:0|> One.<|im_end|>\n<|im_start|>assistant\n<|voice|>")
    ids = processor.apply_chat_template(conversations[0], return_dict=False)
    assert torch.equal(ids, processor("One.")["input_ids"])


@pytest.mark.parametrize(
    "conversation, message",
    [
        ([{"role": "narrator", "content": "x"}], "role"),
        ([{"role": "0", "content": [{"type": "audio", "codes": random_codes(2)}]}], "exactly one transcript"),
        ([{"role": "system", "content": "just text"}], "system text"),
        ([{"role": "assistant", "content": [{"type": "audio", "codes": random_codes(2)}]}], "must follow"),
        ([{"role": "user", "content": [{"type": "audio", "path": "a.wav"}]}], "exactly one transcript"),
        ([{"role": "0", "content": [{"type": "text", "text": "x"}, {"type": "audio"}]}], "exactly one of path"),
        ([{"role": "16", "content": "x"}], "speaker 16"),
        ([], "non-empty"),
    ],
)
def test_bad_conversations_are_refused_with_the_place(conversation, message):
    with pytest.raises(ValueError, match=message):
        conversation_to_script(conversation)


def test_chat_audio_from_a_path_and_a_file_url_become_clips():
    script = conversation_to_script(
        [
            {"role": "0", "content": [{"type": "text", "text": "a"}, {"type": "audio", "path": "/tmp/x.wav"}]},
            {"role": "0", "content": [{"type": "text", "text": "b"}, {"type": "audio", "url": "file:///tmp/y.wav"}]},
            {"role": "0", "content": "go"},
        ]
    )
    assert [r.audio.path for r in script.references] == ["/tmp/x.wav", "file:///tmp/y.wav"]


# ---- saving and loading ----------------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    processor = tiny_processor(chunk_bytes=200)
    processor.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        assert (tmp_path / name).exists()
    assert json.loads((tmp_path / "processor_config.json").read_text())["chunk_bytes"] == 200
    loaded = Drama3Processor.from_pretrained(tmp_path)
    assert loaded.chunk_bytes == 200 and loaded.codec is None
    ref = random_codes(3)
    script = Script("<|speaker:1|>Hello there.", references=[Reference("r", ref, 1)])
    assert torch.equal(loaded(script)["input_ids"], processor(script)["input_ids"])


def test_auto_processor_finds_the_processor(tmp_path):
    from transformers import AutoProcessor

    from transformers_drama3 import register_auto_classes

    register_auto_classes()
    tiny_processor().save_pretrained(tmp_path)
    assert isinstance(AutoProcessor.from_pretrained(tmp_path), Drama3Processor)


def test_auto_processor_finds_it_from_a_model_config_alone(tmp_path):
    """The published repo has no processor_config.json: AutoProcessor goes through model_type."""
    from transformers import AutoProcessor

    from transformers_drama3.configuration_drama3 import Drama3Config
    from transformers_drama3 import register_auto_classes

    register_auto_classes()
    build_drama3_tokenizer(vocab_size=300, save_directory=tmp_path)
    Drama3Config().save_pretrained(tmp_path)
    assert isinstance(AutoProcessor.from_pretrained(tmp_path), Drama3Processor)


def test_tokenizer_files_and_token_band(tmp_path):
    tokenizer = build_drama3_tokenizer(vocab_size=300, codebook_size=16, save_directory=tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).exists()
    # no Jinja template: it could not write the published rows (the processor's layout does)
    assert not (tmp_path / "chat_template.jinja").exists() and tokenizer.chat_template is None
    ids = tokenizer.convert_tokens_to_ids([f"<|semantic:{c}|>" for c in range(16)])
    assert ids == list(range(ids[0], ids[0] + 16))
    assert tokenizer.eos_token == "<|im_end|>"
    text = "Ünïcödé — 日本語 ✓ 🙂"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_a_tokenizer_without_the_special_tokens_is_refused():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    with pytest.raises(ValueError, match="lacks Drama 3 special tokens"):
        Drama3Processor(bare)


def test_save_audio_writes_wav_and_flac(tmp_path):
    import soundfile

    processor = tiny_processor()
    wave = 0.5 * np.sin(np.linspace(0, 200, 4410)).astype(np.float32)
    for name in ("a.wav", "a.flac"):
        processor.save_audio(torch.from_numpy(wave), tmp_path / name)
        read, rate = soundfile.read(tmp_path / name, dtype="float32")
        assert rate == 44100 and np.abs(read - wave).max() < 1e-3
    with pytest.raises(ValueError, match=r"\.wav or \.flac"):
        processor.save_audio(wave, tmp_path / "a.mp3")

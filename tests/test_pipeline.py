"""pipeline("text-to-speech") and ("text-to-audio") on a tiny Drama 3 model: path or instance,
a string, a list of strings, a chat conversation."""

import numpy as np
import pytest
from transformers import pipeline

from transformers_drama3.pipeline_drama3 import text_to_speech_pipeline

GENERATE = {"max_new_tokens": 4, "seed": 0}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


def assert_audio(result, processor):
    assert set(result) == {"audio", "sampling_rate"}
    assert result["sampling_rate"] == 44100
    assert isinstance(result["audio"], np.ndarray) and result["audio"].ndim == 1
    assert result["audio"].shape[0] % processor.samples_per_frame == 0


@pytest.mark.parametrize("task", ["text-to-speech", "text-to-audio"])
def test_a_path_and_a_string(checkpoint, task):
    path, _, processor = checkpoint
    speaker = pipeline(task, model=path)
    assert_audio(speaker("Hello there.", generate_kwargs=GENERATE), processor)


def test_the_audio_is_the_codec_decode_of_what_generate_makes(checkpoint):
    path, model, processor = checkpoint
    speaker = pipeline("text-to-speech", model=model, tokenizer=processor.tokenizer, processor=processor)
    result = speaker("Hello there.", generate_kwargs=GENERATE)
    codes = model.generate(**processor("Hello there."), **GENERATE)
    expected = processor.decode(codes[0]).numpy()
    np.testing.assert_allclose(result["audio"], expected, atol=1e-6)


def test_a_list_of_strings_gives_one_result_each(checkpoint):
    path, _, processor = checkpoint
    results = pipeline("text-to-speech", model=path)(["First line.", "A second, longer line."], generate_kwargs=GENERATE)
    assert len(results) == 2
    for result in results:
        assert_audio(result, processor)


def test_a_chat_conversation(checkpoint):
    path, _, processor = checkpoint
    chat = [{"role": "user", "content": "Hello from a chat."}]
    assert_audio(pipeline("text-to-speech", model=path)(chat, generate_kwargs=GENERATE), processor)


def test_an_instance_through_the_helper(checkpoint):
    path, _, processor = checkpoint
    from transformers_drama3 import Drama3ForSpeechGeneration

    model = Drama3ForSpeechGeneration.from_pretrained(path)
    assert_audio(text_to_speech_pipeline(model)("Hello.", generate_kwargs=GENERATE), processor)

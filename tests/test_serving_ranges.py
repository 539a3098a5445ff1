"""The boundary values of every range the server checks (issue 47: a speaker range widened to 16
went unnoticed): for each field, the last value inside is accepted and the first outside refused,
by name, with its status. Checked on the request parser the routes call, before any work."""

import pytest

from transformers_drama3.decoding.options import MAX_SEED, MAX_TEMPERATURE, MAX_TOP_K
from transformers_drama3.prompting import CHUNK_BYTES
from transformers_drama3.serving.protocol import (
    MIN_CHUNK_BYTES,
    ApiError,
    Limits,
    parse_speech,
    parse_stream_start,
    parse_text_message,
)

LIMITS = Limits()
MAX_CHUNK_BYTES = 4 * CHUNK_BYTES  # what the WebSocket route allows


def is_voice(voice_id: str) -> bool:
    return voice_id == "A"


def speech(**fields):
    return parse_speech({"input": "Hello.", "voice": "A", **fields}, LIMITS, is_voice)


def refused(parse, status: int, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse()
    assert (caught.value.status, caught.value.param) == (status, param), caught.value.message
    assert param.split("[")[0] in caught.value.message


# (field, last value accepted, first value refused, status), each range's both ends
SPEECH_RANGES = [
    ("seed", 0, -1, 400), ("seed", MAX_SEED, MAX_SEED + 1, 400),
    ("max_new_tokens", 1, 0, 400), ("max_new_tokens", LIMITS.max_new_tokens, LIMITS.max_new_tokens + 1, 400),
    ("temperature", 0, -0.001, 400), ("temperature", MAX_TEMPERATURE, MAX_TEMPERATURE + 0.001, 400),
    ("top_p", 1.0, 1.001, 400), ("top_p", 1e-9, 0.0, 400),
    ("top_k", 0, -1, 400), ("top_k", MAX_TOP_K, MAX_TOP_K + 1, 400),
    ("speed", 1.0, 0.24, 400), ("speed", 1.0, 4.01, 400),
]


@pytest.mark.parametrize("name, inside, outside, status", SPEECH_RANGES,
                         ids=[f"{name}-{outside}" for name, _, outside, _ in SPEECH_RANGES])
def test_each_speech_range_accepts_its_last_value_and_refuses_the_next(name, inside, outside, status):
    speech(**{name: inside})
    refused(lambda: speech(**{name: outside}), status, name)


def test_a_reference_speaker_is_0_to_15():
    for speaker in (0, 15):
        assert speech(references=[{"audio": "A", "speaker": speaker}]).references[0][2] == speaker
    for speaker in (-1, 16):
        refused(lambda: speech(references=[{"audio": "A", "speaker": speaker}]), 400, "speaker")


def test_input_and_instructions_are_at_most_max_input_chars():
    speech(input="a" * LIMITS.max_input_chars, instructions="b" * LIMITS.max_input_chars)
    refused(lambda: speech(input="a" * (LIMITS.max_input_chars + 1)), 413, "input")
    refused(lambda: speech(instructions="b" * (LIMITS.max_input_chars + 1)), 413, "instructions")


def test_references_are_at_most_max_references():
    speech(references=[{"audio": "A"}] * LIMITS.max_references)
    refused(lambda: speech(references=[{"audio": "A"}] * (LIMITS.max_references + 1)), 413, "references")


def test_a_text_stream_s_chunk_bytes_and_whole_text_have_their_ranges():
    start = {"type": "start", "voice": "A"}
    for inside in (MIN_CHUNK_BYTES, MAX_CHUNK_BYTES):
        assert parse_stream_start({**start, "chunk_bytes": inside}, LIMITS, is_voice, MAX_CHUNK_BYTES).chunk_bytes == inside
    for outside in (MIN_CHUNK_BYTES - 1, MAX_CHUNK_BYTES + 1):
        refused(lambda: parse_stream_start({**start, "chunk_bytes": outside}, LIMITS, is_voice, MAX_CHUNK_BYTES),
                400, "chunk_bytes")
    piece = {"type": "text", "text": "a" * 10}
    assert parse_text_message(piece, LIMITS.max_input_chars - 10, LIMITS, 1) == "a" * 10
    refused(lambda: parse_text_message(piece, LIMITS.max_input_chars - 9, LIMITS, 1), 413, "input")

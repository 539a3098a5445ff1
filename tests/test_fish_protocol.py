"""Fish Audio's request mapped onto the server's own (`serving.fish_protocol`), and MessagePack
counted before it is unpacked (`serving.msgpack_bounds`): the requests the clients really send map
field by field, nulls and unknown keys are accepted, every bad value is refused naming its field,
and a hostile body is refused by its count before anything is unpacked, its counts equal to a plain
recursive count of what it holds."""

import random

import msgpack
import pytest

pytest.importorskip("av")

from transformers_drama3.serving import fish_protocol  # noqa: E402
from transformers_drama3.serving.fish_protocol import (  # noqa: E402
    fish_live_start,
    fish_speech,
    load_msgpack,
    media_loader,
)
from transformers_drama3.serving.json_bounds import JsonBounds  # noqa: E402
from transformers_drama3.serving.msgpack_bounds import msgpack_cost  # noqa: E402
from transformers_drama3.serving.protocol import ApiError, Limits, VoiceReference, load_json  # noqa: E402
from transformers_drama3.tiny import shipped  # noqa: E402

LIMITS = Limits()


def is_voice(voice_id):
    return voice_id in ("A", "B")


def mapped(body, model="s2-pro"):
    return fish_speech(body, model, "drama3-tiny", LIMITS, is_voice)


def sdk_request(**fields):
    """What fish-audio-sdk 1.3.0's `tts.convert` sends (`TTSRequest.model_dump(exclude_none=True)`)."""
    return {"text": "Good morning to you all.", "chunk_length": 200, "format": "mp3", "mp3_bitrate": 128,
            "opus_bitrate": 32, "references": [], "normalize": True, "latency": "balanced", "top_p": 0.7,
            "temperature": 0.7, "max_new_tokens": 1024, "repetition_penalty": 1.2, "min_chunk_length": 50,
            "condition_on_previous_chunks": True, "early_stop_threshold": 1.0, **fields}


def livekit_request(**fields):
    """What livekit-plugins-fishaudio 1.8.9's `synthesize` sends (`_build_tts_request`)."""
    return {"text": "Good morning to you all.", "chunk_length": 100, "format": "wav", "sample_rate": 24000,
            "mp3_bitrate": 64, "opus_bitrate": 64000, "references": [],
            "reference_id": "933563129e564b19a115bedd57b7406a", "normalize": True, "latency": "balanced",
            "prosody": None, "top_p": 0.7, "temperature": 0.7, "features": ["quality-guard"], **fields}


def test_the_sdk_s_request_maps_onto_the_speech_request():
    fish = mapped(sdk_request())
    speech = fish.speech
    assert (speech.input, speech.voice, speech.response_format, speech.stream_format) == \
        ("Good morning to you all.", None, "mp3", "audio")
    assert speech.sample_rate == 44100  # Fish Audio's rate when none is asked
    assert speech.bit_rate == 128_000 and speech.first_window == 5  # balanced: a 5-frame first chunk
    assert speech.options == {"temperature": 0.7, "top_p": 0.7, "max_new_tokens": 1024}  # the option schema's
    assert (speech.speed, speech.volume_db, speech.references, speech.seed) == (1.0, 0.0, [], None)
    assert fish.chunk_bytes == 200


def test_livekit_s_request_maps_and_its_default_voice_id_speaks_the_default_voice():
    speech = mapped(livekit_request(), model="s2.1-pro").speech
    assert (speech.response_format, speech.sample_rate, speech.voice, speech.bit_rate) == ("wav", 24000, None, None)
    opus = mapped(livekit_request(format="opus", sample_rate=48000)).speech
    assert (opus.sample_rate, opus.bit_rate) == (48000, 64000)  # LiveKit's opus_bitrate is in bits per second


def test_a_stored_voice_with_fish_s_default_id_is_that_voice():
    speech = fish_speech(livekit_request(), None, "drama3-tiny", LIMITS, lambda voice: True).speech
    assert speech.voice == "933563129e564b19a115bedd57b7406a"


@pytest.mark.parametrize("opus_bitrate, expected", [(32, 32_000), (-1000, None), (24000, 24_000), (6, 6000),
                                                    (510_000, 510_000), (None, None)])
def test_opus_bitrate_in_kbps_bits_per_second_or_automatic(opus_bitrate, expected):
    assert mapped(sdk_request(format="opus", opus_bitrate=opus_bitrate)).speech.bit_rate == expected


@pytest.mark.parametrize("model", ["s1", "s1-mini", "s2-pro", "s2.1-pro", "speech-1.5", "speech-1.6", "agent-x0",
                                   "drama-3", "drama3-tiny", None])
def test_fish_audio_s_model_names_and_the_served_one_are_accepted(model):
    assert mapped(sdk_request(), model=model).speech.model == model


def test_nulls_unknown_keys_and_ignored_fields_of_any_value_are_accepted():
    body = {"text": "Hello there.", **{key: None for key in ("chunk_length", "format", "sample_rate", "mp3_bitrate",
                                                               "opus_bitrate", "references", "reference_id", "latency",
                                                               "prosody", "top_p", "temperature", "max_new_tokens",
                                                               "seed")},
            "normalize": "yes", "min_chunk_length": [1], "condition_on_previous_chunks": {"x": 1},
            "early_stop_threshold": "high", "features": None, "repetition_penalty": -3, "something_new": {"a": [1]},
            "prosody": {"normalize_loudness": "maybe"}}
    speech = mapped(body).speech
    assert (speech.response_format, speech.sample_rate, speech.first_window, speech.options) == ("mp3", 44100, None, {})
    assert mapped({"text": "Hi there.", "max_new_tokens": 0}).speech.options == {}  # Fish's 0: the default


def test_prosody_maps_onto_speed_and_volume_and_latency_onto_the_first_window():
    speech = mapped(sdk_request(prosody={"speed": 1.5, "volume": -6.0}, latency="low")).speech
    assert (speech.speed, speech.volume_db, speech.first_window) == (1.5, -6.0, 2)
    assert mapped(sdk_request(latency="normal")).speech.first_window is None


def test_references_are_clip_bytes_as_the_openai_route_s_are_base64():
    clip, transcript = shipped.reference_voice("B")
    data = open(clip, "rb").read()
    speech = mapped(sdk_request(references=[{"audio": data, "text": transcript}])).speech
    [reference] = speech.references
    assert isinstance(reference, VoiceReference) and reference.transcript == transcript and reference.speaker == 0
    assert reference.sampling_rate == 22050 and reference.waveform.size > 0


@pytest.mark.parametrize("fields, status, param", [
    ({"text": None}, 400, "text"),
    ({"text": "..."}, 400, "text"),
    ({"text": "a" * 4097}, 413, "text"),
    ({"format": "flac"}, 400, "format"),
    ({"format": "mp3", "sample_rate": 44000}, 400, "sample_rate"),
    ({"format": "opus", "sample_rate": 24000}, 400, "sample_rate"),
    ({"format": "pcm", "sample_rate": 96000}, 400, "sample_rate"),
    ({"format": "pcm", "sample_rate": 16000.5}, 400, "sample_rate"),
    ({"mp3_bitrate": 1000}, 400, "mp3_bitrate"),
    ({"opus_bitrate": 800}, 400, "opus_bitrate"),
    ({"opus_bitrate": True}, 400, "opus_bitrate"),
    ({"latency": "instant"}, 400, "latency"),
    ({"prosody": 2.0}, 400, "prosody"),
    ({"prosody": {"speed": 5.0}}, 400, "prosody.speed"),
    ({"prosody": {"volume": 30}}, 400, "prosody.volume"),
    ({"prosody": {"speed": float("nan")}}, 400, "prosody.speed"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"max_new_tokens": 5000}, 400, "max_new_tokens"),
    ({"max_new_tokens": -1}, 400, "max_new_tokens"),
    ({"reference_id": 7}, 400, "reference_id"),
    ({"references": [{"audio": b"not audio", "text": "hi"}]}, 400, "references[0].audio"),
    ({"references": [{"audio": b"RIFF", "text": "..."}]}, 400, "references[0].text"),
    ({"chunk_length": 4}, 400, "chunk_length"),
    ({"seed": -1}, 400, "seed"),
])
def test_a_bad_value_is_refused_naming_its_field(fields, status, param):
    with pytest.raises(ApiError) as refused:
        mapped(sdk_request(**fields))
    assert refused.value.status == status
    assert refused.value.param == param and refused.value.message.startswith(param.split("[")[0])
    assert refused.value.body("/v1/tts") == {"status": status, "message": refused.value.message}


def test_an_unknown_model_is_refused_naming_the_header():
    with pytest.raises(ApiError, match="model: 'gpt-4o'") as refused:
        mapped(sdk_request(), model="gpt-4o")
    assert refused.value.status == 400


def test_the_live_start_takes_its_request_without_text():
    fish = fish_live_start({"event": "start", "request": {**livekit_request(), "text": ""}}, "s2.1-pro", "drama3-tiny",
                           LIMITS, is_voice)
    assert fish.speech.input == "" and fish.chunk_bytes == 100
    with pytest.raises(ApiError, match="request"):
        fish_live_start({"event": "start"}, None, "drama3-tiny", LIMITS, is_voice)


def test_the_body_s_loader_goes_by_its_content_type():
    assert media_loader("application/msgpack") is load_msgpack
    assert media_loader("application/json; charset=utf-8") is load_json
    for refused in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        with pytest.raises(ApiError) as error:
            media_loader(refused)
        assert error.value.status == 415


# ---- MessagePack, counted before it is unpacked -----------------------------------------------------


def recursive_cost(value, depth=0):
    """The plain reference: (deepest nesting, items, keys) of an unpacked value, counted as
    `msgpack_cost` counts them (a container is an item, and so is each element or map value)."""
    if isinstance(value, list):
        counts = [recursive_cost(item, depth + 1) for item in value]
        return (max([depth + 1, *(c[0] for c in counts)]), 1 + len(value) + sum(c[1] for c in counts),
                sum(c[2] for c in counts))
    if isinstance(value, dict):
        counts = [recursive_cost(item, depth + 1) for item in value.values()]
        return (max([depth + 1, *(c[0] for c in counts)]), 1 + len(value) + sum(c[1] for c in counts),
                len(value) + sum(c[2] for c in counts))
    return depth, 0, 0


def random_value(rng, depth=0):
    """A document of every MessagePack kind and every length class of header (fix, 8, 16, 32 bits)."""
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, 1, -1, 127, 128, -33, 2**16, -(2**31), 2**63, -(2**63), 2**64 - 1])
    if kind == 2:
        return rng.random() * 1e6
    if kind == 3:
        return rng.choice(["", "ab\u00e9", "x" * 40, "\u4e2d" * 300, "y" * 70000])
    if kind == 4:
        return rng.choice([b"", b"\x00\xff", b"z" * 300, b"w" * 70000])
    if kind == 5:
        return rng.choice([[], {}])
    if kind in (6, 7):
        return [random_value(rng, depth + 1) for _ in range(rng.choice([1, 3, 16, 20]))]
    return {f"k{index}": random_value(rng, depth + 1) for index in range(rng.choice([1, 3, 16, 20]))}


def test_the_count_of_any_document_equals_a_plain_recursive_count():
    rng = random.Random(0)
    for _ in range(200):
        value = random_value(rng)
        data = msgpack.packb(value, use_bin_type=True)
        cost = msgpack_cost(data, JsonBounds(depth=64, items=10**6, keys=10**6))
        assert cost.over is None, cost
        assert (cost.depth, cost.items, cost.keys) == recursive_cost(value)
        assert load_msgpack(data, bounds=JsonBounds(depth=64, items=10**6, keys=10**6)) == value


HOSTILE = ["33 levels", "array of 4 billion", "map of 4 billion", "10,000 empty arrays", "2,001 keys",
           "101 x 100 items", "string past the end", "binary past the end", "ends early", "bytes after it", "0xc1",
           "extension", "timestamp", "key past the end", "empty"]


@pytest.mark.parametrize("data, problem", [
    (b"\x91" * 33 + b"\xc0", "nested deeper than 32 levels"),
    (b"\xdd\xff\xff\xff\xff", "more than 10000 items"),  # an array header promising 4 billion elements
    (b"\xdf\xff\xff\xff\xff", "more than 2000 keys"),  # a map header promising 4 billion entries
    (b"\xdc\x27\x10" + b"\x90" * 10000, "more than 10000 items"),  # 10,000 empty arrays in one
    (msgpack.packb({f"k{index}": 0 for index in range(2001)}), "more than 2000 keys"),
    (msgpack.packb([[0] * 100] * 101), "more than 10000 items"),
    (b"\xdb\x7f\xff\xff\xff" + b"a" * 10, "runs past the end"),  # a string longer than the body
    (b"\xc6\x00\x00\x10\x00", "runs past the end"),
    (b"\x92\x01", "ends early"),
    (msgpack.packb([1, 2]) + b"\x00", "1 bytes follow the document"),
    (b"\xc1", "0xc1"),
    (msgpack.packb(msgpack.ExtType(1, b"xx")), "extension type"),
    (b"\xd6\xff\x00\x00\x00\x00", "extension type"),  # a timestamp
    (b"\x81\xdb", "runs past the end"),
    (b"", "empty"),
], ids=HOSTILE)
def test_a_hostile_body_is_refused_by_its_count_before_anything_is_unpacked(data, problem, monkeypatch):
    def unpack(*args, **kwargs):
        raise AssertionError("unpacked a body the count refuses")

    monkeypatch.setattr(fish_protocol.msgpack, "unpackb", unpack)
    assert problem in msgpack_cost(data).over
    with pytest.raises(ApiError) as refused:
        load_msgpack(data)
    assert refused.value.status == 400 and problem in refused.value.message


def test_a_value_one_past_each_bound_is_refused_and_the_bound_itself_passes():
    bounds = JsonBounds(depth=4, items=20, keys=5)
    assert msgpack_cost(msgpack.packb([[[[]]]]), bounds).over is None
    assert "deeper" in msgpack_cost(msgpack.packb([[[[[]]]]]), bounds).over
    assert msgpack_cost(msgpack.packb([0] * 19), bounds).over is None  # the array and its 19 elements: 20 items
    assert "items" in msgpack_cost(msgpack.packb([0] * 20), bounds).over
    assert msgpack_cost(msgpack.packb({str(i): 0 for i in range(5)}), bounds).over is None
    assert "keys" in msgpack_cost(msgpack.packb({str(i): 0 for i in range(6)}), bounds).over


@pytest.mark.parametrize("data, problem", [
    (b"\xa2\xff\xfe", "not UTF-8"),  # a string of bytes that are not UTF-8
    (b"\x81\x01\x02", "not MessagePack"),  # a map key that is not a string
    (b"\x81\xc0\x02", "not MessagePack"),
], ids=["not UTF-8", "integer key", "nil key"])
def test_strings_that_are_not_utf_8_and_keys_that_are_not_strings_are_refused(data, problem):
    with pytest.raises(ApiError, match=problem) as refused:
        load_msgpack(data)
    assert refused.value.status == 400


def test_a_30_mib_body_of_empty_arrays_is_refused_after_reading_a_few_headers():
    data = b"\xdd" + (2**32 - 1).to_bytes(4, "big") + b"\x90" * (30 * 2**20)
    cost = msgpack_cost(data)
    assert "more than 10000 items" in cost.over and cost.items == 1  # refused at the first header
    nested = b"\x91" * (30 * 2**20)
    assert msgpack_cost(nested).depth == 33  # refused at the 33rd level, the rest never read

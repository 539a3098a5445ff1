"""The server's own entries of the option schema (`decoding.options`, `decode=False`): `voice`,
`response_format`, `speed`, `sample_rate`. Each drives its doors: the HTTP body and the text
stream's `start` message (`serving.protocol`) and Fish Audio's request (`serving.fish_protocol`)
take the ends of each range and refuse one past them with the entry's own words, naming the field;
the formats a door takes are the entry's choices; and no door of the decode (generate(), the CLI,
the demo) offers them, so generate() still refuses them by name."""

import pytest

pytest.importorskip("av")  # a speed other than 1.0 and the encoded formats need PyAV

from test_request_options import EDGES

from transformers_drama3.decoding.options import (
    CLI,
    DEMO,
    GENERATE,
    HTTP,
    OPTIONS,
    SCHEMA,
    SERVING_DEFAULTS,
    STREAM,
    options_for,
)
from transformers_drama3.decoding.request import resolve_settings
from transformers_drama3.generation.call import split_kwargs
from transformers_drama3.serving import audio_formats, output_audio
from transformers_drama3.serving.fish_protocol import FORMATS, fish_speech
from transformers_drama3.serving.protocol import (
    STREAM_AUDIO_FORMATS,
    ApiError,
    Limits,
    parse_speech,
    parse_stream_start,
)

SERVER_OPTIONS = [option for option in SCHEMA if not option.decode]
SERVER_EDGES = [(option, inside, outside) for option, inside, outside in EDGES if not option.decode]
OUTSIDERS = ["ogg", "mp4", "MP3", "wav ", "", 3, True]
"""`response_format` values no door takes (a door treats "" as unset only where it always has)."""


def speech(**fields):
    """The HTTP door: a `/v1/audio/speech` body as the route parses it (pcm, sent whole)."""
    return parse_speech({"input": "Hello.", "response_format": "pcm", "stream": False, **fields}, Limits(),
                        lambda voice: True)


def start(**fields):
    """The text stream's door: its `start` message."""
    return parse_stream_start({"type": "start", **fields}, Limits(), lambda voice: True, 1200)


def refusal(parse, **fields) -> ApiError:
    with pytest.raises(ApiError) as refused:
        parse(**fields)
    assert refused.value.status == 400 and refused.value.body()["error"]["type"] == "invalid_request_error"
    return refused.value


def test_the_servers_own_options_are_offered_over_http_and_never_to_the_decode():
    assert [option.name for option in SERVER_OPTIONS] == ["voice", "response_format", "speed", "sample_rate"]
    for option in SERVER_OPTIONS:
        assert HTTP in option.doors <= {HTTP, STREAM} and not option.sampling, option.name
        assert option not in options_for(HTTP, decode=True) and option in options_for(HTTP, decode=False)
    for door in (GENERATE, CLI, DEMO):
        assert all(option.decode for option in options_for(door)), door
    for option in SERVER_OPTIONS:  # generate() refuses them as it refuses any name it does not read
        with pytest.raises(ValueError, match=rf"unknown arguments \['{option.name}'\]"):
            split_kwargs({option.name: option.default})
    parsed = speech(voice="A", speed=2.0, sample_rate=16000, seed=3)
    assert parsed.options == {"seed": 3}  # the decode's options alone; the resolver never sees the rest
    assert resolve_settings(None, None, None, parsed.options)[0] == SERVING_DEFAULTS


@pytest.mark.parametrize("option, inside, outside", SERVER_EDGES, ids=[f"{o.name}-{out}" for o, _, out in SERVER_EDGES])
def test_each_number_is_taken_at_its_ends_and_refused_one_past_them_at_the_http_door(option, inside, outside):
    assert getattr(speech(**{option.name: inside}), option.name) == inside
    refused = refusal(speech, **{option.name: outside})
    assert refused.param == option.name
    assert refused.message == f"{option.name}={outside!r}; expected {option.expected()}"


@pytest.mark.parametrize("option, inside, outside", SERVER_EDGES, ids=[f"{o.name}-{out}" for o, _, out in SERVER_EDGES])
def test_fish_audios_fields_of_the_same_options_are_held_to_the_same_entries(option, inside, outside):
    def fish(value):
        fields = {"prosody": {"speed": value}} if option.name == "speed" else {option.name: value}
        return fish_speech({"text": "Hello.", "format": "pcm", **fields}, None, "drama3-tiny", Limits(), lambda voice: True)

    assert getattr(fish(inside).speech, option.name) == inside
    field = "prosody.speed" if option.name == "speed" else option.name
    refused = refusal(fish, value=outside)
    assert refused.param == field and refused.message == f"{field}={outside!r}; expected {option.expected()}"


def test_the_http_door_takes_exactly_the_response_format_entrys_choices():
    option = OPTIONS["response_format"]
    taken = set()
    for value in [*option.choices, *OUTSIDERS]:
        try:
            taken.add(speech(response_format=value).response_format)
        except ApiError as refused:
            assert refused.param == "response_format"
            assert refused.message == f"response_format={value!r}; expected {option.expected()}"
    assert taken == set(option.choices)
    assert speech(response_format=None).response_format == option.default  # sent whole, none asked: mp3


def test_the_text_stream_takes_the_entrys_formats_it_can_send():
    option = OPTIONS["response_format"]
    assert set(STREAM_AUDIO_FORMATS) < set(option.choices) and set(FORMATS) < set(option.choices)
    taken = set()
    for value in [*option.choices, *OUTSIDERS]:
        try:
            taken.add(start(response_format=value).response_format)
        except ApiError as refused:
            assert refused.param == "response_format"
    assert taken == set(STREAM_AUDIO_FORMATS)
    assert start().response_format == start(response_format="").response_format == STREAM_AUDIO_FORMATS[0]
    assert refusal(start, response_format=3).message == f"response_format=3; expected {option.expected()}"


@pytest.mark.parametrize("parse", [speech, start], ids=["http", "stream"])
def test_a_voice_is_any_id_and_nothing_else_at_both_doors(parse):
    assert OPTIONS["voice"].doors == {HTTP, STREAM}
    for voice in ("A", "a voice with spaces", "ünïcode"):
        assert parse(voice=voice).voice == parse(voice={"id": voice}).voice == voice
    for wrong in (1, True, "", {"id": 2}, ["A"]):
        assert refusal(parse, voice=wrong).param == "voice"


def test_the_audio_writers_and_the_schema_agree():
    """`output_audio` applies speed within the entry's bounds (it reads them from the schema); the
    encoder (`audio_formats`) writes every format the entry offers, each of them streamed."""
    assert set(audio_formats.MEDIA_TYPES) == set(audio_formats.STREAMABLE) == set(OPTIONS["response_format"].choices)
    assert (OPTIONS["speed"].low, OPTIONS["speed"].high) == (output_audio.MIN_SPEED, output_audio.MAX_SPEED)

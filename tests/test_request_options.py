"""The option schema (`decoding.options`): every per-request option defined once (name, type,
range, default, help), and every door derived from it. generate(), the HTTP body and the text
stream's start message, the `say` / `eval` flags and the demo's sampling panel take exactly the
schema's entries for their door, accept the limits of each range and refuse one past them, naming
the option the way the door names it."""

import math
import re

import pytest

from transformers_drama3.cli import CommandError, _check_say_arguments
from transformers_drama3.runtime.command_line import EVAL_OPTIONS, SAY_OPTIONS, build_parser
from transformers_drama3.decoding.options import (
    CLI, DEMO, GENERATE, HTTP, OPTIONS, PRESETS, SAMPLING_NAMES, SCHEMA, STREAM, SamplingSettings, check_options,
    options_for,
)
from transformers_drama3.decoding.request import resolve_settings
from transformers_drama3.generation.arguments import GENERATION_FIELDS, REFUSED, WORKS
from transformers_drama3.generation.call import DRAMA3_FIELDS, OWN_ARGUMENTS

NUMBERS = [option for option in SCHEMA if option.kind in (int, float)]


def edges(option) -> list[tuple[object, object]]:
    """(the last value inside, the first outside) at each end of an option's range."""
    step = 1 if option.kind is int else 1e-6
    found = []
    if option.low is not None:
        inside = option.low + step if option.low_open else option.low
        outside = option.low if option.low_open else option.low - step
        found.append((inside, outside))
    if option.high is not None:
        found.append((option.high, option.high + step if option.kind is int else option.high * (1 + 1e-6) + step))
    return found


EDGES = [(option, inside, outside) for option in NUMBERS for inside, outside in edges(option)]
EDGE_IDS = [f"{option.name}-{outside}" for option, _, outside in EDGES]


@pytest.mark.parametrize("option, inside, outside", EDGES, ids=EDGE_IDS)
def test_each_number_takes_the_ends_of_its_range_and_refuses_one_past_them_by_name(option, inside, outside):
    check_options({option.name: inside})
    with pytest.raises(ValueError, match=re.escape(f"{option.name}={outside!r}; expected {option.expected()}")):
        check_options({option.name: outside})


WRONG_TYPES = {
    float: ["1", True, math.nan, math.inf, None.__class__],
    int: ["1", True, 2.5, math.nan],
    bool: ["yes", 1, 0.0],
    str: [1, True],
}


@pytest.mark.parametrize("option", SCHEMA, ids=lambda option: option.name)
def test_no_option_takes_a_value_of_another_type_and_a_bool_is_never_a_number(option):
    for value in WRONG_TYPES[option.kind]:
        assert not option.accepts(value), value
        with pytest.raises(ValueError, match=f"^{option.name}="):
            option.check(value)


def test_the_sampling_settings_are_the_schemas_sampling_options_with_its_defaults():
    fields = SamplingSettings.__dataclass_fields__
    assert tuple(fields) == SAMPLING_NAMES
    assert all(fields[name].default == OPTIONS[name].default for name in SAMPLING_NAMES)


def test_sampling_settings_are_checked_when_made():
    with pytest.raises(ValueError, match="^top_p=0; expected"):
        SamplingSettings(top_p=0)


def test_the_presets_are_the_preset_options_choices():
    assert tuple(PRESETS) == OPTIONS["preset"].choices


def test_every_option_has_help_and_a_door():
    for option in SCHEMA:
        assert option.help and option.doors, option.name


# ---- generate()


def test_generate_takes_every_schema_option_transformers_names_and_refuses_none_of_them():
    named = {option.name for option in options_for(GENERATE)} & GENERATION_FIELDS
    assert named <= WORKS and not named & REFUSED.keys()


def test_drama3s_own_generation_options_are_the_schemas_that_transformers_lacks():
    own = {option.name for option in options_for(GENERATE)} - GENERATION_FIELDS - set(OWN_ARGUMENTS)
    assert own <= DRAMA3_FIELDS and own


SAMPLING_EDGES = [edge for edge in EDGES if edge[0].sampling]


@pytest.mark.parametrize("option, inside, outside", SAMPLING_EDGES,
                         ids=[f"{option.name}-{outside}" for option, _, outside in SAMPLING_EDGES])
def test_generates_options_are_refused_one_past_their_range_from_any_source(option, inside, outside):
    resolve_settings(None, None, None, {option.name: inside})
    with pytest.raises(ValueError, match=f"^{option.name}="):
        resolve_settings(None, None, None, {option.name: outside})


# ---- the CLI


def say_args(tmp_path, *flags):
    return build_parser().parse_args(["say", "hi", "-o", str(tmp_path / "x.wav"), *flags])


def test_say_has_one_flag_per_option_of_the_cli_and_eval_the_sampling_ones(tmp_path):
    parsed = vars(say_args(tmp_path))
    assert {option.name for option in options_for(CLI)} <= parsed.keys()
    assert SAY_OPTIONS == options_for(CLI)
    assert {option.name for option in EVAL_OPTIONS} == {
        option.name for option in options_for(CLI) if option.sampling or option.kind is bool
    }


CLI_EDGES = [(option, inside, outside) for option, inside, outside in EDGES if CLI in option.doors]


@pytest.mark.parametrize("option, inside, outside", CLI_EDGES, ids=[f"{o.cli_flag}-{out}" for o, _, out in CLI_EDGES])
def test_each_flag_takes_its_limits_and_refuses_one_past_them_naming_the_flag(tmp_path, option, inside, outside):
    given = _check_say_arguments(say_args(tmp_path, f"{option.cli_flag}={inside}"))
    assert given[option.name] == inside
    shown = option.kind(outside)  # as the flag's type reads it
    with pytest.raises(CommandError, match="^" + re.escape(f"{option.cli_flag} {shown}: expected {option.expected()}")):
        _check_say_arguments(say_args(tmp_path, f"{option.cli_flag}={outside}"))


def test_a_switch_is_said_on_or_off(tmp_path):
    assert _check_say_arguments(say_args(tmp_path, "--ras", "off", "--alignment", "on")) == {
        "repetition_aware": False, "phoneme_alignment": True,
    }


# ---- HTTP and the text stream


@pytest.mark.parametrize("door", [HTTP, STREAM])
def test_a_body_gives_exactly_the_options_of_its_door(door):
    pytest.importorskip("fastapi")
    from transformers_drama3.serving.protocol import Limits, request_options

    body = {option.name: edges(option)[0][0] if option.kind in (int, float) else True for option in SCHEMA
            if option.kind is not str}
    given = request_options(body, door, Limits())
    assert set(given) == {option.name for option in options_for(door) if option.kind is not str and option.decode}


HTTP_EDGES = [(option, inside, outside) for option, inside, outside in EDGES if HTTP in option.doors and option.decode]


@pytest.mark.parametrize("option, inside, outside", HTTP_EDGES, ids=[f"{o.name}-{out}" for o, _, out in HTTP_EDGES])
def test_each_field_is_refused_one_past_its_range_in_openais_error_shape(option, inside, outside):
    pytest.importorskip("fastapi")
    from transformers_drama3.serving.protocol import ApiError, Limits, request_options

    request_options({option.name: inside}, HTTP, Limits(max_new_tokens=10**9))
    with pytest.raises(ApiError) as refused:
        request_options({option.name: outside}, HTTP, Limits(max_new_tokens=10**9))
    body = refused.value.body()["error"]
    assert (refused.value.status, body["param"], body["type"]) == (400, option.name, "invalid_request_error")
    assert body["message"].startswith(f"{option.name}=")


# ---- the demo


def test_the_demo_panel_has_one_field_per_option_of_the_demo_refused_by_its_label():
    gradio = pytest.importorskip("gradio")
    from transformers_drama3.serving.demo import Director
    from transformers_drama3.serving.director import TAKE_OPTIONS
    from transformers_drama3.serving.protocol import Limits

    assert TAKE_OPTIONS == options_for(DEMO)
    director = Director.__new__(Director)
    director.limits = Limits(max_new_tokens=10**9)
    for option, inside, outside in [edge for edge in EDGES if DEMO in edge[0].doors]:
        settings = director.settings("model default", **{option.name: inside})
        assert (settings.seed if option.name == "seed" else settings.options[option.name]) == inside
        with pytest.raises(gradio.Error) as refused:
            director.settings("model default", **{option.name: outside})
        assert refused.value.message.startswith(f"{option.demo_label}: {option.name}={outside!r}; expected")

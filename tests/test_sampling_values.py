"""One check of sampling values (`decoding.options.check_options`) for every entry point:
`generate()`, the CLI and the demo refuse the same values, one past each limit, naming them."""

import math

import pytest

from generation_helpers import prompt, tiny_model
from transformers_drama3.cli import CommandError, _check_say_arguments, build_parser
from transformers_drama3.decoding.options import MAX_TEMPERATURE, MAX_TOP_K, check_options

ACCEPTED = [
    {"temperature": 0}, {"temperature": MAX_TEMPERATURE}, {"top_p": 1.0}, {"top_p": 1e-6}, {"top_k": 0},
    {"top_k": MAX_TOP_K}, {"max_new_tokens": 1}, {"repetition_aware": False}, {"temperature": None},
]
REFUSED = [
    ({"temperature": -1e-9}, "temperature"), ({"temperature": MAX_TEMPERATURE + 0.5}, "temperature"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": "1"}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.0 + 1e-9}, "top_p"),
    ({"top_p": math.nan}, "top_p"), ({"top_k": -1}, "top_k"), ({"top_k": MAX_TOP_K + 1}, "top_k"),
    ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"repetition_aware": "yes"}, "repetition_aware"),
]


@pytest.mark.parametrize("values", ACCEPTED, ids=str)
def test_values_at_each_limit_are_accepted(values):
    check_options(values)


@pytest.mark.parametrize("values, name", REFUSED, ids=str)
def test_values_one_past_each_limit_are_refused_naming_the_field(values, name):
    with pytest.raises(ValueError, match=f"^{name}="):
        check_options(values)


@pytest.mark.parametrize("values, name", [case for case in REFUSED if case[1] != "max_new_tokens"], ids=str)
def test_generate_refuses_what_the_check_refuses_before_any_work(values, name):
    model = tiny_model(seed=0)
    ids, codes = prompt(1)
    with pytest.raises(ValueError, match=f"^{name}="):
        model.generate(ids[None], codes[None], **values)


@pytest.mark.parametrize("flag, value", [("--temperature", "nan"), ("--temperature", "10.5"), ("--top-p", "0"),
                                         ("--top-p", "1.01")])
def test_the_cli_refuses_what_the_check_refuses_naming_the_flag(tmp_path, flag, value):
    args = build_parser().parse_args(["say", "hi", "-o", str(tmp_path / "x.wav"), flag, value])
    with pytest.raises(CommandError, match=f"^{flag} {float(value)}: expected "):
        _check_say_arguments(args)


def test_the_demo_refuses_what_the_check_refuses():
    gradio = pytest.importorskip("gradio")
    from transformers_drama3.serving.demo import Director

    director = Director.__new__(Director)
    with pytest.raises(gradio.Error, match="Temperature: temperature=10.5"):
        director.settings("serving", seed=1, temperature=10.5)
    with pytest.raises(gradio.Error, match="Top-p: top_p=1.5"):
        director.settings("serving", seed=1, top_p=1.5)


@pytest.mark.parametrize("values, name", [case for case in REFUSED if case[1] in ("temperature", "top_p", "top_k")], ids=str)
def test_the_http_protocol_refuses_what_the_check_refuses_naming_the_field(values, name):
    pytest.importorskip("fastapi")
    from transformers_drama3.serving.protocol import ApiError, Limits, request_options

    with pytest.raises(ApiError) as refused:
        request_options(values, "http", Limits())
    assert refused.value.param == name and str(refused.value).startswith(f"{name}=")


def test_the_http_protocol_takes_what_the_check_takes():
    pytest.importorskip("fastapi")
    from transformers_drama3.serving.protocol import Limits, request_options

    values = {"temperature": 10, "top_p": 1.0, "top_k": 0}
    assert request_options(values, "http", Limits()) == values

"""The speech server under attack, on loopback (issue 47): every hostile input gets a JSON error in
OpenAI's shape naming its field, never a plain-text 500 or a dropped socket; the connection that
carried it keeps serving. Each test bounds its requests and waits."""

import json
import logging

import httpx
import pytest
from network_helpers import serving_on_loopback

uvicorn = pytest.importorskip("uvicorn")
websockets_sync = pytest.importorskip("websockets.sync.client")
ConnectionClosed = pytest.importorskip("websockets.exceptions").ConnectionClosed

from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402

API_KEY = "attack-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
WAIT = 60  # seconds any one request may take on a busy 2-core machine


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    service = SpeechService.load(None, str(tmp_path_factory.mktemp("voices")), max_batch=4, max_queue=8)
    yield service
    service.engine.stop()


@pytest.fixture(scope="module")
def server(service):
    app = create_app(lambda: service, ServerSettings(api_key=API_KEY, request_timeout=60))
    with serving_on_loopback(app) as port:
        yield f"127.0.0.1:{port}"


def post_raw(client: httpx.Client, path: str, body: str) -> httpx.Response:
    """POST a body written by hand (JSON's NaN, huge numbers and escapes exactly as an attacker sends them)."""
    return client.post(path, content=body.encode(), headers=HEADERS, timeout=WAIT)


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if param is not None:
        assert param in error["message"]
    return error


SPEECH = '{"input": "Hello.", "voice": "A", "max_new_tokens": 2, '
HOSTILE_SPEECH_BODIES = [
    (SPEECH + '"temperature": NaN}', "temperature"),
    (SPEECH + '"temperature": Infinity}', "temperature"),
    (SPEECH + '"top_p": NaN}', "top_p"),
    (SPEECH + '"top_p": -Infinity}', "top_p"),
    (SPEECH + '"seed": ' + "9" * 5000 + "}", "seed"),
    (SPEECH + '"nested": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
    (SPEECH + '"instructions": "whispering \\ud800"}', "instructions"),
    ('{"input": "Hello \\udfff there.", "voice": "A"}', "input"),
    ('{"input": "Hello.", "voice": "\\ud800"}', "voice"),
    ('{"input": "Hello.", "references": [{"audio": "AAAA", "text": "hi \\ud800"}]}', "references[0].text"),
]


@pytest.mark.parametrize("body, param", HOSTILE_SPEECH_BODIES,
                         ids=["nan-temperature", "inf-temperature", "nan-top_p", "minus-inf-top_p", "5000-digit-seed",
                              "100000-deep", "surrogate-instructions", "surrogate-input", "surrogate-voice",
                              "surrogate-reference-text"])
def test_hostile_speech_bodies_get_a_400_naming_the_field_and_the_connection_keeps_serving(server, body, param):
    with httpx.Client(base_url=f"http://{server}") as client:
        assert_openai_error(post_raw(client, "/v1/audio/speech", body), 400, param)
        # the same keep-alive connection answers the next request
        assert client.get("/health", timeout=WAIT).json()["status"] == "ok"


def test_a_voice_named_with_a_lone_surrogate_is_refused_and_the_list_still_answers(server, service):
    with httpx.Client(base_url=f"http://{server}") as client:
        body = '{"id": "surrogate", "name": "\\ud800", "audio": "AAAA", "text": "Hello."}'
        assert_openai_error(post_raw(client, "/v1/audio/voices", body), 400, "name")
        listed = client.get("/v1/audio/voices", headers=HEADERS, timeout=WAIT)
    assert listed.status_code == 200 and "surrogate" not in [voice["id"] for voice in listed.json()["voices"]]
    assert not (service.voices.root / "surrogate").exists()


def test_an_unexpected_failure_answers_openai_s_shape_with_500_and_logs_one_line(service, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("the disk caught fire")

    app = create_app(lambda: service, ServerSettings(api_key=API_KEY))
    monkeypatch.setattr(service, "job", broken)
    with serving_on_loopback(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        with caplog.at_level(logging.ERROR, logger="transformers_drama3.serving"):
            response = post_raw(client, "/v1/audio/speech", '{"input": "Hello.", "voice": "A"}')
        error = assert_openai_error(response, 500, None)
        assert error["type"] == "server_error" and "RuntimeError" in error["message"]
        assert client.get("/health", timeout=WAIT).json()["status"] == "ok"
    logged = [record for record in caplog.records if "RuntimeError" in record.getMessage()]
    assert len(logged) == 1 and "\n" not in logged[0].getMessage()


# ---- the text-stream WebSocket: the same inputs close with an error and 4400 ---------------------------

START = '{"type": "start", "voice": "A", "max_new_tokens": 2, '


def closed_with(server, messages):
    """Send raw text messages; (close code, the one error event)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    connection = websockets_sync.connect(f"ws://{server}/v1/audio/speech/stream", additional_headers=headers,
                                         open_timeout=WAIT, max_size=None)
    events = []
    try:
        for message in messages:
            connection.send(message)
        while True:
            message = connection.recv(timeout=WAIT)
            if isinstance(message, str):
                events.append(json.loads(message))
    except ConnectionClosed:
        pass
    errors = [event for event in events if event["type"] == "error"]
    assert len(errors) == 1, events
    return connection.close_code, errors[0]["error"]


@pytest.mark.parametrize(
    "messages, param",
    [
        ([START + '"temperature": NaN}'], "temperature"),
        ([START + '"top_p": Infinity}'], "top_p"),
        ([START + '"seed": ' + "7" * 5000 + "}"], "seed"),
        ([START + '"x": ' + "[" * 100_000 + "]" * 100_000 + "}"], "messages[0]"),
        ([START + '"voice": "\\ud800"}'], "voice"),
        ([START[:-2] + "}", '{"type": "text", "text": "Hello \\ud800."}', '{"type": "done"}'], "text"),
    ],
    ids=["nan-temperature", "inf-top_p", "5000-digit-seed", "100000-deep", "surrogate-voice", "surrogate-text"],
)
def test_hostile_text_stream_messages_get_an_error_and_close_code_4400(server, messages, param):
    code, error = closed_with(server, messages)
    assert code == 4400 and error["param"] == param and error["message"]

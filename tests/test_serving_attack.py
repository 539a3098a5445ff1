"""The speech server under attack, on loopback (issue 47): every hostile input gets a JSON error in
OpenAI's shape naming its field, never a plain-text 500 or a dropped socket; the connection that
carried it keeps serving. Each test bounds its requests and waits."""

import base64
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile
import torch
from network_helpers import free_port, serving_on_loopback

uvicorn = pytest.importorskip("uvicorn")
websockets_sync = pytest.importorskip("websockets.sync.client")
websockets_exceptions = pytest.importorskip("websockets.exceptions")
ConnectionClosed = websockets_exceptions.ConnectionClosed

from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402
from transformers_drama3.serving.connections import header_timeout_protocol  # noqa: E402
from transformers_drama3.tiny import shipped  # noqa: E402

API_KEY = "attack-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
WAIT = 60  # seconds any one request may take on a busy 2-core machine


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    service = SpeechService.load(None, str(tmp_path_factory.mktemp("voices")), max_batch=4, max_queue=8)
    yield service
    service.engine.stop()


def cli_protocol():
    """The HTTP protocol `drama3 serve` runs (uvicorn's h11 with a deadline for request heads)."""
    return header_timeout_protocol(10.0)


@pytest.fixture(scope="module")
def server(service):
    app = create_app(lambda: service, ServerSettings(api_key=API_KEY, request_timeout=60))
    with serving_on_loopback(app, http=cli_protocol()) as port:
        yield f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def keyless(service):
    """A default server, as `drama3 serve` starts without a key: the loopback port."""
    with serving_on_loopback(create_app(lambda: service, ServerSettings(request_timeout=60)), http=cli_protocol()) as port:
        yield port


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


# ---- the voices registry: checked before the disk, exclusive per id, damage contained ---------------


def clip_body(name, voice_id=None, gain=1.0):
    clip, transcript = shipped.reference_voice("B")
    samples, rate = soundfile.read(clip, dtype="float32")
    buffer = io.BytesIO()
    soundfile.write(buffer, samples * gain, rate, format="WAV")
    body = {"name": name, "audio": base64.b64encode(buffer.getvalue()).decode(), "text": transcript}
    return body if voice_id is None else {**body, "id": voice_id}


def listed(client) -> dict:
    response = client.get("/v1/audio/voices", headers=HEADERS, timeout=WAIT)
    assert response.status_code == 200, response.text
    return {voice["id"]: voice["name"] for voice in response.json()["voices"]}


def hidden_folders(service) -> list[str]:
    return sorted(path.name for path in service.voices.root.iterdir() if path.name.startswith(".") and path.name != ".locks")


@pytest.mark.parametrize("fields, param", [
    ({"voice_id": "A\n"}, "id"), ({"voice_id": "../A"}, "id"), ({"voice_id": "nl\r"}, "id"),
    ({"name": "Ann\nBob"}, "name"), ({"name": "A\u200b"}, "name"), ({"name": "x" * 500}, "name"),
], ids=["id-newline", "id-traversal", "id-carriage-return", "name-newline", "name-zero-width", "name-long"])
def test_a_voice_id_or_name_that_is_not_clean_is_refused_before_the_disk(server, service, fields, param):
    body = clip_body(fields.get("name", "clean"), fields.get("voice_id", "clean-id"))
    before = sorted(path.name for path in service.voices.root.iterdir())
    with httpx.Client(base_url=f"http://{server}") as client:
        assert_openai_error(client.post("/v1/audio/voices", json=body, headers=HEADERS, timeout=WAIT), 400, param)
        assert "clean-id" not in listed(client)
    assert sorted(path.name for path in service.voices.root.iterdir()) == before


def test_concurrent_creates_of_one_id_store_one_voice_and_refuse_the_others_with_409(server, service):
    bodies = [clip_body(f"twin {index}", "twin", gain=1.0 - index / 20) for index in range(8)]
    with httpx.Client(base_url=f"http://{server}") as client, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda body: client.post("/v1/audio/voices", json=body, headers=HEADERS, timeout=WAIT),
                                bodies))
        statuses = sorted(answer.status_code for answer in answers)
        assert statuses == [200] + [409] * 7, [answer.text for answer in answers]
        winner = next(answer.json()["name"] for answer in answers if answer.status_code == 200)
        for answer in answers:
            if answer.status_code == 409:
                assert answer.json()["error"]["param"] == "id"
        assert listed(client)["twin"] == winner  # the client told 200 owns the stored voice
        assert client.delete("/v1/audio/voices/twin", headers=HEADERS, timeout=WAIT).status_code == 200
    assert hidden_folders(service) == []


def test_a_create_while_another_process_holds_the_id_answers_409(server, service):
    from transformers_drama3.serving.voices import VoiceStore

    other = VoiceStore(service.voices.root, service.processor)  # a second server on the same folder
    with other._claim("held"), httpx.Client(base_url=f"http://{server}") as client:
        refused = client.post("/v1/audio/voices", json=clip_body("held"), headers=HEADERS, timeout=WAIT)
        error = assert_openai_error(refused, 409, "id")
        assert error["code"] == "voice_busy" and "held" not in listed(client)


def test_damaged_voice_folders_are_left_out_of_the_list_and_named_in_a_clear_error(server, service, caplog):
    root = service.voices.root
    shutil.copytree(root / "A", root / "truncated")
    (root / "truncated" / "voice.json").write_text('{"name": "trunc', encoding="utf-8")
    shutil.copytree(root / "A", root / "clipless")
    (root / "clipless" / "reference_0.wav").unlink()
    try:
        with httpx.Client(base_url=f"http://{server}") as client:
            with caplog.at_level(logging.WARNING, logger="transformers_drama3.serving.voices"):
                voices = listed(client)
            assert "A" in voices and "truncated" not in voices and "clipless" not in voices
            warned = " ".join(record.getMessage() for record in caplog.records)
            assert "truncated" in warned and "clipless" in warned
            for voice in ("truncated", "clipless"):
                answer = post_raw(client, "/v1/audio/speech", json.dumps({"input": "Hello.", "voice": voice, "max_new_tokens": 2}))
                error = assert_openai_error(answer, 409, "voice")
                assert error["code"] == "voice_damaged" and voice in error["message"]
    finally:
        shutil.rmtree(root / "truncated")
        shutil.rmtree(root / "clipless")


def test_a_failed_write_keeps_the_old_voice_and_leaves_nothing_behind(server, service, monkeypatch):
    from transformers_drama3.serving import voices as voices_module

    replace = voices_module.os.replace

    def full_disk(source, target):  # the folder's rename into place fails; a file's rename still works
        if voices_module.os.path.isdir(source):
            raise OSError(28, "No space left on device")
        replace(source, target)

    references = service.voices.references("A")
    files = {path.name: path.read_bytes() for path in (service.voices.root / "A").iterdir()}
    with httpx.Client(base_url=f"http://{server}") as client:
        monkeypatch.setattr(voices_module.os, "replace", full_disk)
        refused = client.post("/v1/audio/voices", json=clip_body("doomed"), headers=HEADERS, timeout=WAIT)
        with pytest.raises(OSError):
            service.voices.add("A", [voices_module.VoiceReference(np.zeros(22050, np.float32) + 0.1, 22050, "Hi.")],
                               replace=True)
        monkeypatch.undo()
        assert "doomed" not in listed(client) and "A" in listed(client)
        assert assert_openai_error(refused, 500, None)["code"] == "voice_write_failed"
        spoken = post_raw(client, "/v1/audio/speech", '{"input": "Hello.", "voice": "A", "max_new_tokens": 2, "response_format": "wav"}')
        assert spoken.status_code == 200
    assert {path.name: path.read_bytes() for path in (service.voices.root / "A").iterdir()} == files
    assert service.voices.references("A") is references  # the cache still holds the unchanged voice
    assert hidden_folders(service) == []


def test_a_voice_replaced_by_another_server_is_read_again(server, service):
    from transformers_drama3.serving.voices import VoiceReference, VoiceStore

    other = VoiceStore(service.voices.root, service.processor)  # a second server on the same folder
    with httpx.Client(base_url=f"http://{server}") as client:
        assert client.post("/v1/audio/voices", json=clip_body("shared", gain=1.0), headers=HEADERS, timeout=WAIT).status_code == 200
    first = service.voices.references("shared")
    other.delete("shared")
    clip, transcript = shipped.reference_voice("A")
    samples, rate = soundfile.read(clip, dtype="float32")
    other.add("shared", [VoiceReference(samples, rate, transcript)])
    again = service.voices.references("shared")
    assert not torch.equal(first[0].audio, again[0].audio)
    assert torch.equal(again[0].audio, other.references("shared")[0].audio)
    other.delete("shared")


def test_folders_left_by_interrupted_writes_are_swept_when_a_store_opens(service, tmp_path):
    from transformers_drama3.serving.voices import VoiceStore

    shutil.copytree(service.voices.root / "A", tmp_path / "kept")
    (tmp_path / ".staging.upload.k3j2h1").mkdir()
    (tmp_path / ".staging.upload.k3j2h1" / "reference_0.wav").write_bytes(b"\0" * 2**20)  # killed mid-upload
    (tmp_path / ".trash.gone.a1b2c3" / "gone").mkdir(parents=True)  # killed mid-delete
    (tmp_path / ".old.moved.x9y8z7").mkdir()
    shutil.copytree(service.voices.root / "A", tmp_path / ".old.moved.x9y8z7" / "moved")  # killed mid-replace
    store = VoiceStore(tmp_path, service.processor)
    assert sorted(path.name for path in tmp_path.iterdir()) == [".locks", "kept", "moved"]
    assert store.ids() == ["kept", "moved"]


# ---- a client that leaves cancels its request, streamed or not ----------------------------------------

LONG_TEXT = " ".join(["The river ran past the old mill, and the miller's children watched the boats go by."] * 6)


def test_a_non_streamed_request_is_cancelled_soon_after_its_client_leaves(server, service):
    cancelled = service.metrics.outcomes["cancelled"]
    body = {"input": LONG_TEXT, "voice": "A", "max_new_tokens": 3000, "seed": 1, "response_format": "wav", "stream": False}
    with httpx.Client(base_url=f"http://{server}") as client:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            client.post("/v1/audio/speech", json=body, headers=HEADERS, timeout=httpx.Timeout(WAIT, read=1.5))
    left = time.perf_counter()
    while service.metrics.outcomes["cancelled"] == cancelled and time.perf_counter() - left < 8:
        time.sleep(0.05)
    assert service.metrics.outcomes["cancelled"] == cancelled + 1
    assert time.perf_counter() - left < 3  # polled on a timer, not only when no frame arrived
    deadline = time.perf_counter() + 5
    while service.engine.running and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert service.engine.running == 0


# ---- exposure: the key guards every route but /health; errors and listings clients can read ----------


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/redoc", "/v1/models", "/v1/audio/voices"])
def test_with_a_key_every_route_but_health_needs_it(server, path):
    with httpx.Client(base_url=f"http://{server}") as client:
        refused = client.get(path, timeout=WAIT)
        assert assert_openai_error(refused, 401, None)["code"] == "invalid_api_key"
        assert client.get(path, headers={"Authorization": "Bearer not-the-key"}, timeout=WAIT).status_code == 401
        assert client.get(path, headers=HEADERS, timeout=WAIT).status_code == 200
        assert client.get("/health", timeout=WAIT).status_code == 200


def test_open_listings_let_a_front_end_list_models_and_voices_without_the_key_and_nothing_else(service):
    app = create_app(lambda: service, ServerSettings(api_key=API_KEY, open_listings=True))
    with serving_on_loopback(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        assert client.get("/v1/audio/models", timeout=WAIT).json()["models"][0] == {"id": "drama3-tiny"}
        assert client.get("/v1/models", timeout=WAIT).json()["data"][0]["id"] == "drama3-tiny"
        assert {"id": "A", "name": "A"} in client.get("/v1/audio/voices", timeout=WAIT).json()["voices"]
        assert client.post("/v1/audio/voices", json=clip_body("intruder"), timeout=WAIT).status_code == 401
        assert client.delete("/v1/audio/voices/A", timeout=WAIT).status_code == 401
        assert client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "A"}, timeout=WAIT).status_code == 401
        assert client.get("/metrics", timeout=WAIT).status_code == 401


def test_a_public_bind_without_a_key_warns(monkeypatch, capsys):
    from transformers_drama3 import cli
    from transformers_drama3.cli import main
    from transformers_drama3.serving import app as app_module

    monkeypatch.setattr(app_module, "serve_in_background", lambda *args, **kwargs: ((lambda: None), None))
    monkeypatch.setattr(cli, "listen", lambda host, port: None)  # binds nothing
    monkeypatch.setattr(cli, "run_server", lambda *args: None)
    monkeypatch.delenv("DRAMA3_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 0
    assert "warning" in capsys.readouterr().err.lower()
    assert main(["serve", "--host", "127.0.0.1"]) == 0
    assert "warning" not in capsys.readouterr().err.lower()
    assert main(["serve", "--body-timeout", "0"]) == 2
    assert "--body-timeout 0" in capsys.readouterr().err
    monkeypatch.setenv("DRAMA3_API_KEY", "from-the-environment")
    assert main(["serve", "--host", "0.0.0.0"]) == 0
    assert "warning" not in capsys.readouterr().err.lower()


def test_a_full_queue_answers_429_with_retry_after(server, service):
    saved, service.engine.max_queue = service.engine.max_queue, 0
    try:
        with httpx.Client(base_url=f"http://{server}") as client:
            refused = post_raw(client, "/v1/audio/speech", '{"input": "Hello.", "voice": "A", "max_new_tokens": 2}')
    finally:
        service.engine.max_queue = saved
    assert assert_openai_error(refused, 429, None)["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/audio/voices/v1", 405), ("GET", "/v1/nothing", 404),
                                                  ("PUT", "/v1/audio/speech", 405)])
def test_unknown_routes_and_methods_answer_in_openai_s_shape(server, method, path, status):
    with httpx.Client(base_url=f"http://{server}") as client:
        assert_openai_error(client.request(method, path, headers=HEADERS, timeout=WAIT), status, None)


@pytest.mark.parametrize("text", ["\u0000", "\u200b\u200b\u200b", "\U0001f600\U0001f600", "\ue000\ue001", "?! ... --"],
                         ids=["nul", "zero-width", "emoji", "private-use", "punctuation"])
def test_input_with_nothing_speakable_is_refused(server, text):
    with httpx.Client(base_url=f"http://{server}") as client:
        refused = post_raw(client, "/v1/audio/speech", json.dumps({"input": text, "voice": "A", "max_new_tokens": 2}))
        assert_openai_error(refused, 400, "input")


def test_stream_false_with_a_stream_format_is_refused(server):
    with httpx.Client(base_url=f"http://{server}") as client:
        body = {"input": "Hello.", "voice": "A", "max_new_tokens": 2, "stream": False, "stream_format": "sse"}
        assert_openai_error(post_raw(client, "/v1/audio/speech", json.dumps(body)), 400, "stream")


# ---- bounded buffering and timeouts -----------------------------------------------------------------


@pytest.fixture(scope="module")
def strict_server(service):
    """A server with small limits: 64 KiB bodies, 1 s for a body or a text-stream message."""
    settings = ServerSettings(api_key=API_KEY, max_body_bytes=64 * 2**10, body_timeout=1.0, stream_idle_timeout=1.0)
    app = create_app(lambda: service, settings)
    with serving_on_loopback(app) as port:
        yield port, app


def raw_request(port: int, head: bytes, body_parts, wait: float = 10.0) -> bytes:
    """Send a request's head and body parts on a socket, then read what comes back within `wait` s."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as connection:
        connection.sendall(head)
        for part in body_parts:
            connection.sendall(part)
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                data = connection.recv(65536)
                if not data:
                    break
                answer += data
        except socket.timeout:
            pass
        return answer


def test_a_chunked_body_over_the_limit_is_refused_while_it_is_read(strict_server):
    port, _ = strict_server
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (16 * 2**10, b" " * 16 * 2**10)
    started = time.perf_counter()
    answer = raw_request(port, head, [chunk] * 8)  # 128 KiB sent, no last chunk: the body never ends
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"body_too_large"' in answer and time.perf_counter() - started < 5


def test_a_body_that_stops_arriving_gets_408_and_its_connection_closed(strict_server):
    port, _ = strict_server
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n")
    started = time.perf_counter()
    answer = raw_request(port, head, [b'{"input": "'])  # 11 of 1000 declared bytes, then silence
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"timeout_error"' in answer and time.perf_counter() - started < 5


def test_a_text_stream_that_never_starts_or_goes_quiet_is_closed_with_4408(strict_server):
    port, app = strict_server
    url = f"127.0.0.1:{port}"
    started = time.perf_counter()
    code, error = closed_with(url, [])  # connects, never sends start
    assert (code, error["code"]) == (4408, "timeout") and "start" in error["message"]
    code, error = closed_with(url, [START[:-2] + "}", '{"type": "text", "text": "Hello"}'])  # then silence, no done
    assert (code, error["code"]) == (4408, "timeout")
    assert time.perf_counter() - started < 20
    deadline = time.perf_counter() + 10
    while app.state.text_streams.active and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert app.state.text_streams.active == 0


def test_a_speaker_without_a_voice_is_told_how_to_give_one_over_http(server):
    with httpx.Client(base_url=f"http://{server}") as client:
        body = {"input": "Hello there. <|speaker:15|>Goodbye.", "voice": "A", "max_new_tokens": 2}
        error = assert_openai_error(post_raw(client, "/v1/audio/speech", json.dumps(body)), 400, "input")
    assert "speaker 15" in error["message"] and "references" in error["message"]
    assert "strict_speakers" not in error["message"]  # a Python argument an HTTP client cannot pass


def test_a_new_voice_s_audio_is_not_said_to_be_a_voice_id(server):
    with httpx.Client(base_url=f"http://{server}") as client:
        body = {"name": "copy", "audio": "A", "text": "Hello."}  # the id of a stored voice is not audio
        answer = client.post("/v1/audio/voices", json=body, headers=HEADERS, timeout=WAIT)
    error = assert_openai_error(answer, 400, "references[0].audio")
    assert "voice id" not in error["message"]


def test_a_client_that_leaves_mid_body_logs_no_error(strict_server, caplog):
    port, _ = strict_server
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
                connection.sendall(head + b'{"input": ')  # 10 of 1000 bytes, then gone
        time.sleep(0.5)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            assert client.get("/health", timeout=WAIT).status_code == 200
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []


# ---- issue 58: a web page cannot drive the server (content type, Host, Origin) -----------------------

SPEAK = json.dumps({"input": "Hello.", "voice": "A", "max_new_tokens": 2, "response_format": "wav"})


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None],
                         ids=["text-plain", "form", "multipart", "none"])
def test_a_body_a_page_may_send_cross_site_unasked_is_refused_415_and_changes_nothing(keyless, content_type):
    headers = {"Origin": f"http://127.0.0.1:{keyless}"} | ({"Content-Type": content_type} if content_type else {})
    with httpx.Client(base_url=f"http://127.0.0.1:{keyless}") as client:
        stored = client.post("/v1/audio/voices", content=json.dumps(clip_body("csrf")).encode(), headers=headers,
                             timeout=WAIT)
        assert assert_openai_error(stored, 415, None)["code"] == "unsupported_media_type"
        spoken = client.post("/v1/audio/speech", content=SPEAK.encode(), headers=headers, timeout=WAIT)
        assert assert_openai_error(spoken, 415, None)["code"] == "unsupported_media_type"
        assert "csrf" not in listed(client)
        json_typed = client.post("/v1/audio/speech", content=SPEAK.encode(), timeout=WAIT,
                                 headers={**headers, "Content-Type": "application/json; charset=utf-8"})
        assert json_typed.status_code == 200 and json_typed.content[:4] == b"RIFF"


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", "/v1/audio/voices"), ("POST", "/v1/audio/speech"),
                                          ("GET", "/metrics"), ("GET", "/openapi.json"), ("DELETE", "/v1/audio/voices/A")])
def test_a_host_that_does_not_name_the_server_is_refused_403_so_dns_rebinding_reaches_nothing(keyless, service, method,
                                                                                            path):
    with httpx.Client(base_url=f"http://127.0.0.1:{keyless}") as client:
        answer = client.request(method, path, content=SPEAK.encode() if method == "POST" else None, timeout=WAIT,
                                headers={"Host": f"evil.example:{keyless}", "Content-Type": "application/json"})
        error = assert_openai_error(answer, 403, None)
        assert (error["type"], error["code"]) == ("permission_error", "forbidden_host")
        assert "evil.example" in error["message"]
        assert client.get("/health", headers={"Host": "evil.example"}, timeout=WAIT).status_code == 200  # a probe by address
        for name in ("localhost", "127.0.0.1", "[::1]", "LOCALHOST."):
            assert client.get("/v1/models", headers={"Host": f"{name}:{keyless}"}, timeout=WAIT).status_code == 200, name
    assert "A" in service.voices


def test_a_trailing_slash_redirect_never_points_at_another_host(keyless):
    with httpx.Client(base_url=f"http://127.0.0.1:{keyless}") as client:
        refused = client.get("/v1/models/", headers={"Host": "evil.example"}, timeout=WAIT)
        assert refused.status_code == 403 and "location" not in refused.headers
        redirect = client.get("/v1/models/", timeout=WAIT)
        assert redirect.status_code == 307 and redirect.headers["location"] == f"http://127.0.0.1:{keyless}/v1/models"


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://localhost"])
def test_a_page_of_another_origin_is_refused_403_on_http_and_the_websocket(keyless, origin):
    with httpx.Client(base_url=f"http://127.0.0.1:{keyless}") as client:
        headers = {"Origin": origin, "Content-Type": "application/json"}
        error = assert_openai_error(client.post("/v1/audio/speech", content=SPEAK.encode(), headers=headers, timeout=WAIT),
                                    403, None)
        assert (error["type"], error["code"]) == ("permission_error", "forbidden_origin")
        assert client.get("/v1/audio/voices", headers={"Origin": origin}, timeout=WAIT).status_code == 403
        same_site = client.post("/v1/audio/speech", content=SPEAK.encode(), timeout=WAIT,
                                headers={"Origin": f"http://127.0.0.1:{keyless}", "Content-Type": "application/json"})
        assert same_site.status_code == 200  # the server's own page (/docs) speaks
    with pytest.raises(websockets_exceptions.InvalidStatus) as refused:
        websockets_sync.connect(f"ws://127.0.0.1:{keyless}/v1/audio/speech/stream", origin=origin, open_timeout=WAIT)
    assert refused.value.response.status_code == 403
    assert json.loads(refused.value.response.body)["error"]["code"] == "forbidden_origin"
    for own in (f"http://127.0.0.1:{keyless}", None):  # the server's own page, and a client that is no browser
        with websockets_sync.connect(f"ws://127.0.0.1:{keyless}/v1/audio/speech/stream", origin=own,
                                     open_timeout=WAIT) as connection:
            connection.send(START[:-2] + "}")
            assert json.loads(connection.recv(timeout=WAIT))["type"] == "ready"


def test_allowed_hosts_and_origins_let_those_names_and_pages_in_with_cors_headers(service):
    settings = ServerSettings(allowed_hosts=("localhost", "127.0.0.1", "tts.example"),
                              allowed_origins=("https://app.example",))
    app = create_app(lambda: service, settings)
    with serving_on_loopback(app, http=cli_protocol()) as port, \
            httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        named = client.get("/v1/models", headers={"Host": f"tts.example:{port}"}, timeout=WAIT)
        assert named.status_code == 200
        asked = client.options("/v1/audio/speech", timeout=WAIT, headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert asked.status_code == 200 and asked.headers["access-control-allow-origin"] == "https://app.example"
        spoken = client.post("/v1/audio/speech", content=SPEAK.encode(), timeout=WAIT,
                             headers={"Origin": "https://app.example", "Content-Type": "application/json"})
        assert spoken.status_code == 200 and spoken.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-seed" in spoken.headers["access-control-expose-headers"].lower()
        other = client.post("/v1/audio/speech", content=SPEAK.encode(), timeout=WAIT,
                            headers={"Origin": "https://other.example", "Content-Type": "application/json"})
        assert assert_openai_error(other, 403, None)["code"] == "forbidden_origin"
        assert client.get("/v1/models", headers={"Host": "evil.example"}, timeout=WAIT).status_code == 403


def test_drama3_serve_allows_the_loopback_names_its_bound_address_and_the_names_given(monkeypatch, capsys):
    from transformers_drama3 import cli
    from transformers_drama3.serving import app as app_module

    started = {}
    monkeypatch.setattr(app_module, "serve_in_background", lambda *args, **kwargs: ((lambda: None), None))
    monkeypatch.setattr(app_module, "create_app", lambda get_service, settings: started.setdefault("settings", settings))
    monkeypatch.setattr(cli, "listen", lambda host, port: None)  # binds nothing
    monkeypatch.setattr(cli, "run_server", lambda *args: None)
    monkeypatch.setenv("DRAMA3_API_KEY", "key")
    assert cli.main(["serve"]) == 0
    assert (started.pop("settings").allowed_hosts, capsys.readouterr().err.count("--allowed-hosts")) == (
        ("localhost", "127.0.0.1", "[::1]"), 0)
    assert cli.main(["serve", "--host", "192.168.1.5", "--allowed-hosts", "tts.example,Box.Local",
                     "--allowed-origins", "https://App.example", "--allowed-origins", "http://localhost:3000"]) == 0
    settings = started.pop("settings")
    assert settings.allowed_hosts == ("localhost", "127.0.0.1", "[::1]", "192.168.1.5", "tts.example", "box.local")
    assert settings.allowed_origins == ("https://app.example", "http://localhost:3000")
    assert cli.main(["serve", "--host", "0.0.0.0"]) == 0
    assert started.pop("settings").allowed_hosts == ("localhost", "127.0.0.1", "[::1]")
    assert "--allowed-hosts" in capsys.readouterr().err  # a wildcard bind says which names it answers
    assert cli.main(["serve", "--host", "::", "--allowed-hosts", "*"]) == 0
    assert "*" in started.pop("settings").allowed_hosts
    assert cli.main(["serve", "--allowed-origins", "evil.example"]) == 2
    assert "--allowed-origins 'evil.example'" in capsys.readouterr().err


# ---- issue 58: one framing per request, heads of bounded size ----------------------------------------


def read_until_closed(port: int, data: bytes, wait: float = 10.0) -> tuple[bytes, bool]:
    """Send `data` in one write; what arrives until the server closes (True) or `wait` s pass (False)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as connection:
        try:
            connection.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while True:
                received = connection.recv(65536)
                if not received:
                    return answer, True
                answer += received
        except socket.timeout:
            return answer, False
        except ConnectionResetError:
            return answer, True


def test_content_length_with_transfer_encoding_is_refused_and_the_smuggled_request_never_answered(keyless):
    body = b'{"input": "Hello.", "voice": "A", "max_new_tokens": 2}'
    smuggled = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    request = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) + smuggled)
    answer, closed = read_until_closed(keyless, request)
    assert closed and answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # the GET after the last chunk got no answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "ambiguous_framing"
    with httpx.Client(base_url=f"http://127.0.0.1:{keyless}") as client:  # one framing still works, either one
        assert client.post("/v1/audio/speech", content=SPEAK.encode(), headers={"Content-Type": "application/json"},
                           timeout=WAIT).status_code == 200
        assert client.post("/v1/audio/speech", content=iter([SPEAK.encode()]), timeout=WAIT,
                           headers={"Content-Type": "application/json"}).status_code == 200


@pytest.mark.parametrize("head, status", [
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 17_000 + b"\r\n\r\n", 431),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(b"X-%d: 1\r\n" % n for n in range(5000)) + b"\r\n", 431),
    (b"GET /health?" + b"q" * 100_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 414),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 17_000, 431),
], ids=["17-kb-header", "5000-headers", "100-kb-url", "incomplete-17-kb"])
def test_a_head_over_the_limits_sent_in_one_write_is_refused_and_its_connection_closed(keyless, head, status):
    answer, closed = read_until_closed(keyless, head)
    assert closed and answer.startswith(b"HTTP/1.1 %d" % status), answer[:300]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"] == "invalid_request_error"
    with httpx.Client(base_url=f"http://127.0.0.1:{keyless}") as client:
        assert client.get("/health", headers={"X-Fits": "a" * 8000}, timeout=WAIT).status_code == 200


# ---- issue 58: bodies are counted before they are parsed, off the event loop -------------------------


def test_hostile_bodies_are_refused_while_health_keeps_answering(keyless):
    nested = b"[" + b"[]," * 10_000_000 + b"[]]"  # ~30 MiB: 10 M lists once parsed
    keys = ("{" + ",".join(f'"{n:x}":0' for n in range(2_900_000)) + "}").encode()
    latencies, stop = [], threading.Event()

    def poll():
        with httpx.Client(base_url=f"http://127.0.0.1:{keyless}") as client:
            while not stop.is_set():
                started = time.perf_counter()
                assert client.get("/health", timeout=WAIT).status_code == 200
                latencies.append(time.perf_counter() - started)
                stop.wait(0.05)

    def post(body):
        return httpx.post(f"http://127.0.0.1:{keyless}/v1/audio/speech", content=body, timeout=WAIT,
                          headers={"Content-Type": "application/json"})

    with ThreadPoolExecutor(4) as pool:
        poller = pool.submit(poll)
        answers = list(pool.map(post, [nested, nested, keys]))
        stop.set()
        poller.result()
    for answer, bound in zip(answers, ("10000 items", "10000 items", "2000 keys")):
        assert bound in assert_openai_error(answer, 400, None)["message"]
    assert len(latencies) >= 3 and max(latencies) < 2.0, latencies  # the loop parsed none of them


def test_a_text_stream_message_of_too_many_items_is_refused_with_4400(server):
    code, error = closed_with(server, [START + '"x": [' + "[]," * 500_000 + "[]]}"])
    assert code == 4400 and error["param"] == "messages[0]" and "10000 items" in error["message"]


# ---- issue 58: exit codes that say what failed -----------------------------------------------------


def serve_process(*flags, timeout: float = 240) -> subprocess.CompletedProcess:
    """`drama3 serve` on loopback in a subprocess, until it exits by itself."""
    command = [sys.executable, "-m", "transformers_drama3.cli", "serve", "--host", "127.0.0.1", "--threads", "1", *flags]
    return subprocess.run(command, capture_output=True, timeout=timeout, env={**os.environ, "DRAMA3_API_KEY": ""})


def last_line(done: subprocess.CompletedProcess) -> str:
    """The server's last stderr line, after checking it printed no traceback."""
    error = done.stderr.decode(errors="replace")
    assert "Traceback" not in error, error[-3000:]
    return error.strip().splitlines()[-1]


def test_a_port_in_use_exits_with_exit_bind_and_one_line_before_anything_loads(tmp_path):
    from transformers_drama3.runtime.command_line import EXIT_BIND

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.perf_counter()
        done = serve_process("--port", str(port), "--voices-dir", str(tmp_path / "voices"))
    assert done.returncode == EXIT_BIND, done.stderr.decode(errors="replace")[-3000:]
    line = last_line(done)
    assert line.startswith(f"drama3 serve: cannot listen on 127.0.0.1:{port}: address already in use"), line
    assert not (tmp_path / "voices").exists()  # refused before the model and its voices were loaded
    assert time.perf_counter() - started < 120


@pytest.mark.parametrize("what", ["model", "adapter"])
def test_a_model_or_adapter_that_fails_to_load_exits_with_exit_load_and_one_line(tmp_path, what):
    from transformers_drama3.runtime.command_line import EXIT_LOAD

    broken = tmp_path / "broken"
    broken.mkdir()
    flags = ["--voices-dir", str(tmp_path / "voices"), "--port", str(free_port())]
    if what == "model":
        (broken / "config.json").write_text('{"model_type": "drama3"', encoding="utf-8")  # cut short
        flags += ["--model", str(broken)]
    else:
        flags += ["--adapter", f"me={broken}"]  # a folder without the adapter's files
    done = serve_process(*flags)
    assert done.returncode == EXIT_LOAD, done.stderr.decode(errors="replace")[-3000:]
    line = last_line(done)
    assert line.startswith("drama3 serve: could not load: ") and ("--model" if what == "model" else "me") in line, line


# ---- issue 58: a stream cut by --timeout ends with an error ----------------------------------------


@pytest.fixture(scope="module")
def hasty(service):
    """A server whose requests may take 8 s (`--timeout 8`): the loopback port. A stream's response
    starts with its first audio (a timeout before it is a 504), so the limit leaves a busy machine
    time for the first audio and still cuts the long take (3,000 frames) midway."""
    app = create_app(lambda: service, ServerSettings(request_timeout=8.0))
    with serving_on_loopback(app, http=cli_protocol()) as port:
        yield port


def long_stream_body(stream_format: str) -> dict:
    return {"input": LONG_TEXT, "voice": "A", "max_new_tokens": 3000, "seed": 3, "response_format": "pcm",
            "stream_format": stream_format}


def test_an_sse_stream_cut_by_the_timeout_ends_with_an_error_event_and_no_done(hasty, caplog):
    events = []
    with httpx.stream("POST", f"http://127.0.0.1:{hasty}/v1/audio/speech", json=long_stream_body("sse"),
                      timeout=WAIT) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    kinds = [event["type"] for event in events]
    assert "speech.audio.done" not in kinds and kinds[-1] == "error" and kinds.count("error") == 1, kinds
    assert set(kinds[:-1]) <= {"speech.audio.delta"}  # audio (if any came in time), then the cut
    error = events[-1]["error"]
    assert set(error) == {"message", "type", "param", "code"} and (error["type"], error["code"]) == ("timeout_error", "timeout")


def test_a_raw_audio_stream_cut_by_the_timeout_is_an_unfinished_chunked_stream(hasty):
    received = b""
    with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
        with httpx.stream("POST", f"http://127.0.0.1:{hasty}/v1/audio/speech", json=long_stream_body("audio"),
                          timeout=WAIT) as response:
            assert response.status_code == 200
            for chunk in response.iter_bytes():
                received += chunk
    with httpx.Client(base_url=f"http://127.0.0.1:{hasty}") as client:  # and the server serves on
        assert client.get("/health", timeout=WAIT).status_code == 200


# ---- issue 58: the WebSocket checks text and closes as HTTP answers ----------------------------------


def stream_outcome(server, messages) -> tuple[int, list[dict], int]:
    """(close code, JSON events, bytes of audio) of a text stream sent `messages`."""
    connection = websockets_sync.connect(f"ws://{server}/v1/audio/speech/stream", open_timeout=WAIT, max_size=None,
                                         additional_headers={"Authorization": f"Bearer {API_KEY}"})
    events, audio = [], 0
    try:
        for message in messages:
            connection.send(message)
        while True:
            message = connection.recv(timeout=WAIT)
            if isinstance(message, str):
                events.append(json.loads(message))
            else:
                audio += len(message)
    except ConnectionClosed:
        pass
    return connection.close_code, events, audio


@pytest.mark.parametrize("pieces", [["\U0001f600", "\U0001f600 "], ["\u200b\u200b"], ["\u0000"], ["?! ", "... --"], ["   "], []],
                         ids=["emoji", "zero-width", "nul", "punctuation", "blank", "no-text"])
def test_a_text_stream_with_nothing_speakable_is_refused_as_http_refuses_it(server, pieces):
    messages = [START[:-2] + "}", *[json.dumps({"type": "text", "text": piece}) for piece in pieces], '{"type": "done"}']
    code, events, audio = stream_outcome(server, messages)
    errors = [event["error"] for event in events if event["type"] == "error"]
    assert (code, audio, len(errors)) == (4400, 0, 1), events
    assert errors[0]["param"] == "input" and "nothing" in errors[0]["message"]
    with httpx.Client(base_url=f"http://{server}") as client:  # what HTTP says of the same text
        http = post_raw(client, "/v1/audio/speech", json.dumps({"input": "".join(pieces), "voice": "A", "max_new_tokens": 2}))
        assert assert_openai_error(http, 400, "input")["message"] == errors[0]["message"]


def test_a_text_stream_that_starts_with_emoji_speaks_all_of_it(server):
    messages = [START[:-2] + "}", json.dumps({"type": "text", "text": "\U0001f600 "}),
                json.dumps({"type": "text", "text": "Hello there."}), '{"type": "done"}']
    code, events, audio = stream_outcome(server, messages)
    assert code == 1000 and audio > 0 and events[-1]["type"] == "done"
    spoken = "".join(event["text"] for event in events if event["type"] == "chunk.started")
    assert "\U0001f600 Hello there." in spoken, spoken  # the held piece was spoken with the rest


def write_adapter(base, folder, seed: int) -> None:
    """A "light" LoRA adapter of drama3-tiny (rank 4, small random weights) saved in `folder`."""
    import copy

    from transformers_drama3.serving.adapter_layers import BASE_FILE, base_fingerprint
    from transformers_drama3.training.lora import apply_lora

    peft = apply_lora(copy.deepcopy(base), "light", r=4)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in (parameter for parameter in peft.parameters() if parameter.requires_grad):
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    peft.save_pretrained(folder)
    (folder / BASE_FILE).write_text(json.dumps(base_fingerprint(base.config)))


def test_a_text_stream_for_an_adapter_when_every_slot_is_busy_closes_4429_with_the_retry_delay(tmp_path, bundled_tiny):
    for name, seed in (("calm", 1), ("bright", 2)):
        write_adapter(bundled_tiny[0], tmp_path / name, seed)
    service = SpeechService.load(None, str(tmp_path / "voices"), max_batch=2, max_queue=4, max_adapters=1, adapter_rank=8,
                                 adapter_specs=[f"calm={tmp_path / 'calm'}", f"bright={tmp_path / 'bright'}"])
    app = create_app(lambda: service, ServerSettings(api_key=API_KEY))
    lease = service.adapters.acquire("calm")  # the one slot serves a running request
    try:
        with serving_on_loopback(app, http=cli_protocol()) as port:
            start = json.dumps({"type": "start", "voice": "bright", "max_new_tokens": 2})
            messages = [start, '{"type": "text", "text": "Hello there."}', '{"type": "done"}']
            connection = websockets_sync.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream", open_timeout=WAIT,
                                                 additional_headers={"Authorization": f"Bearer {API_KEY}"})
            events = []
            with pytest.raises(ConnectionClosed):
                for message in messages:
                    connection.send(message)
                while True:
                    message = connection.recv(timeout=WAIT)
                    if isinstance(message, str):
                        events.append(json.loads(message))
            http = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", headers=HEADERS, timeout=WAIT,
                              json={"input": "Hello there.", "voice": "bright", "max_new_tokens": 2})
    finally:
        lease.release()
        service.engine.stop()
    error = events[-1]
    assert connection.close_code == 4429 and error["type"] == "error", events
    assert (error["error"]["code"], error["retry_after"]) == ("adapter_slots_busy", 1)
    assert connection.close_reason.endswith("; retry after 1 s")
    assert http.status_code == 429 and http.headers["Retry-After"] == "1"  # what HTTP answers the same request
    assert http.json()["error"]["code"] == error["error"]["code"]


# ---- issue 58: error messages without server paths or Python internals -------------------------------


def assert_public(error: dict, *hidden: str) -> None:
    """A client's error message: short, no absolute path of the server, no Python internals."""
    message = error["message"]
    assert len(message) <= 400, len(message)
    for text in ("embedded null byte", "BytesIO", " object at 0x", "Traceback", *hidden):
        assert text not in message, message


def test_unreadable_audio_and_long_echoes_are_answered_without_python_internals(server):
    with httpx.Client(base_url=f"http://{server}") as client:
        garbage = {"name": "noise", "audio": base64.b64encode(b"garbage" * 10).decode(), "text": "Hello."}
        error = assert_openai_error(client.post("/v1/audio/voices", json=garbage, headers=HEADERS, timeout=WAIT),
                                    400, "references[0].audio")
        assert_public(error)
        assert "not a readable audio file" in error["message"]
        for body in ({"input": "Hello.", "voice": "v" * 100_000}, {"input": "Hello.", "response_format": "x" * 100_000}):
            answer = post_raw(client, "/v1/audio/speech", json.dumps(body))
            assert answer.status_code in (400, 404)
            assert_public(answer.json()["error"])
            assert "characters left out" in answer.json()["error"]["message"]


def test_a_failure_s_text_and_a_failed_write_s_path_stay_in_the_server_log(service, monkeypatch, caplog):
    from transformers_drama3.serving import voices as voices_module

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error", "/srv/drama3/secret/cache.bin")

    app = create_app(lambda: service, ServerSettings(api_key=API_KEY))
    with serving_on_loopback(app, http=cli_protocol()) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        monkeypatch.setattr(service, "job", broken)
        with caplog.at_level(logging.ERROR, logger="transformers_drama3.serving"):
            failed = post_raw(client, "/v1/audio/speech", '{"input": "Hello.", "voice": "A"}')
        error = assert_openai_error(failed, 500, None)
        assert_public(error, "/srv", "secret", "Input/output")
        assert "OSError" in error["message"]
        monkeypatch.setattr(voices_module.os, "replace", broken)
        refused = client.post("/v1/audio/voices", json=clip_body("unwritten"), headers=HEADERS, timeout=WAIT)
        error = assert_openai_error(refused, 500, None)
        assert error["code"] == "voice_write_failed" and "Input/output error" in error["message"]
        assert_public(error, "/srv", "secret")
    assert "/srv/drama3/secret/cache.bin" in " ".join(record.getMessage() for record in caplog.records)


def test_adapter_paths_are_refused_naming_the_field_without_the_server_s_folders(tmp_path):
    root = tmp_path / "adapter-root"
    (root / "empty").mkdir(parents=True)
    service = SpeechService.load(None, str(tmp_path / "voices"), max_batch=2, max_queue=4, adapter_root=str(root),
                                 max_adapters=1, adapter_rank=4, start_engine=False)
    app = create_app(lambda: service, ServerSettings(api_key=API_KEY))
    with serving_on_loopback(app, http=cli_protocol()) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        def register(path):
            return client.post("/v1/audio/voices", json={"id": "far", "adapter": {"path": path}}, headers=HEADERS,
                               timeout=WAIT)

        for path in ("me\x00/adapter", "x" * 100_000):
            assert_public(assert_openai_error(register(path), 400, "adapter.path"), str(tmp_path))
        for path in ("empty", "missing"):  # inside the root, not an adapter: named as the client gave it
            error = assert_openai_error(register(path), 400, "adapter")
            assert_public(error, str(tmp_path))
            assert f"({path})" in error["message"]
        refused = register("../..")
        outside = refused.json()["error"]
        assert refused.status_code == 403 and outside["param"] == "adapter.path"
        assert outside["type"] == "permission_error" and outside["code"] == "adapter_forbidden"
        assert_public(outside, str(tmp_path))


# ---- round two (issue 58): damaged voices, clip lengths, transcripts, claims -------------------------


def test_a_voice_json_nested_100000_deep_is_skipped_and_logged_and_the_list_still_answers(server, service, caplog):
    root = service.voices.root
    shutil.copytree(root / "A", root / "deep")
    (root / "deep" / "voice.json").write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    try:
        with httpx.Client(base_url=f"http://{server}") as client:
            with caplog.at_level(logging.WARNING, logger="transformers_drama3.serving.voices"):
                voices = listed(client)  # was a 500 for everyone (RecursionError)
            assert "A" in voices and "deep" not in voices
            warned = [record.getMessage() for record in caplog.records if "'deep'" in record.getMessage()]
            assert warned and "nested deeper than" in warned[0]
            answer = post_raw(client, "/v1/audio/speech", json.dumps({"input": "Hello.", "voice": "deep", "max_new_tokens": 2}))
            assert assert_openai_error(answer, 409, "voice")["code"] == "voice_damaged"
    finally:
        shutil.rmtree(root / "deep")


@pytest.mark.parametrize("text", ["\U0001f600\U0001f600", "\u200b\u200b\u200b", "?! ... --"],
                         ids=["emoji", "zero-width", "punctuation"])
def test_a_transcript_with_nothing_speakable_is_refused_as_the_input_is(server, service, text):
    with httpx.Client(base_url=f"http://{server}") as client:
        body = {**clip_body("mute"), "id": "mute", "text": text}
        error = assert_openai_error(client.post("/v1/audio/voices", json=body, headers=HEADERS, timeout=WAIT), 400,
                                    "references[0].text")
        assert "nothing speakable" in error["message"] and "mute" not in listed(client)
        inline = {"input": "Hello.", "max_new_tokens": 2, "references": [{"audio": body["audio"], "text": text}]}
        assert_openai_error(post_raw(client, "/v1/audio/speech", json.dumps(inline)), 400, "references[0].text")
    assert not (service.voices.root / "mute").exists()


def long_clip_body(voice_id: str, seconds: float) -> dict:
    """Voice A's clip repeated to `seconds` (whole samples), as a create body."""
    clip, transcript = shipped.reference_voice("A")
    samples, rate = soundfile.read(clip, dtype="float32")
    buffer = io.BytesIO()
    soundfile.write(buffer, np.resize(samples, int(seconds * rate)), rate, format="WAV")
    return {"id": voice_id, "name": voice_id, "audio": base64.b64encode(buffer.getvalue()).decode(), "text": transcript}


def test_a_clip_the_length_limit_takes_at_create_is_taken_at_every_use(server, service):
    """One measure of a reference's length at create and at use: a 59.998 s clip was stored, then
    refused on every request as "60.0 s long"; one over the limit is refused at create, its length
    written so that it reads over the limit."""
    with httpx.Client(base_url=f"http://{server}") as client:
        stored = client.post("/v1/audio/voices", json=long_clip_body("minute", 59.998), headers=HEADERS, timeout=WAIT)
        assert stored.status_code == 200, stored.text
        try:
            spoken = post_raw(client, "/v1/audio/speech", json.dumps({"input": "Hello.", "voice": "minute",
                                                                        "max_new_tokens": 2, "response_format": "wav"}))
            assert spoken.status_code == 200, spoken.text
            assert service.voices.references("minute")[0].audio.shape[1] == service.processor.max_reference_frames
        finally:
            assert client.delete("/v1/audio/voices/minute", headers=HEADERS, timeout=WAIT).status_code == 200
        over = client.post("/v1/audio/voices", json=long_clip_body("too-long", 60.05), headers=HEADERS, timeout=WAIT)
        error = assert_openai_error(over, 400, "references[0].audio")
        assert "60.05 s long" in error["message"] and "too-long" not in listed(client)


def test_a_create_that_fails_after_claiming_its_id_leaves_the_id_free(server, service, monkeypatch):
    """A failed create gives its claim back: forced to fail after the claim (the disk refuses the
    write), the same id is then created; no thread race needed to see a claim that was kept."""
    from transformers_drama3.serving import voices as voices_module

    def full_disk(folder, references, name):
        raise OSError(28, "No space left on device")

    with httpx.Client(base_url=f"http://{server}") as client:
        monkeypatch.setattr(voices_module.VoiceStore, "_write", staticmethod(full_disk))
        failed = client.post("/v1/audio/voices", json=clip_body("phoenix"), headers=HEADERS, timeout=WAIT)
        monkeypatch.undo()
        assert assert_openai_error(failed, 500, None)["code"] == "voice_write_failed"
        assert "phoenix" not in listed(client)
        again = client.post("/v1/audio/voices", json=clip_body("phoenix"), headers=HEADERS, timeout=WAIT)
        assert again.status_code == 200, again.text
        assert client.delete("/v1/audio/voices/phoenix", headers=HEADERS, timeout=WAIT).status_code == 200
    assert hidden_folders(service) == []

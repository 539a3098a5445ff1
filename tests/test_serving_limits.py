"""The server's connection limits on loopback (issue 47): a request head that stalls is answered 408
and its connection closed after `--header-timeout` (uvicorn alone holds it open for ever); a
malformed request gets its 400 as JSON; a WebSocket's error closes carry a reason; the key can come
from a file. Each test bounds its waits."""

import json
import socket
import time

import httpx
import pytest
from network_helpers import LOOPBACK, serving_on_loopback

uvicorn = pytest.importorskip("uvicorn")
websockets_sync = pytest.importorskip("websockets.sync.client")
ConnectionClosed = pytest.importorskip("websockets.exceptions").ConnectionClosed

from transformers_drama3.serving.app import ServerSettings, SpeechService, close_reason, create_app  # noqa: E402
from transformers_drama3.serving.connections import header_timeout_protocol  # noqa: E402
from transformers_drama3.serving.keys import resolve_api_key  # noqa: E402

API_KEY = "limits-key"
HEADER_TIMEOUT = 0.5
WAIT = 30


def serving(app, http="h11"):
    """uvicorn on a free loopback port with the given HTTP protocol (the CLI's, or uvicorn's own)."""
    return serving_on_loopback(app, http=http)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    service = SpeechService.load(None, str(tmp_path_factory.mktemp("voices")), max_batch=2, max_queue=4)
    yield service
    service.engine.stop()


@pytest.fixture(scope="module")
def app(service):
    return create_app(lambda: service, ServerSettings(api_key=API_KEY, stream_idle_timeout=1.5))


@pytest.fixture(scope="module")
def port(app):
    with serving(app, header_timeout_protocol(HEADER_TIMEOUT)) as port:
        yield port


def read_until_closed(connection: socket.socket, wait: float) -> tuple[bytes, bool]:
    """What arrives until the server closes the connection (True) or `wait` seconds pass (False)."""
    connection.settimeout(wait)
    answer = b""
    try:
        while True:
            data = connection.recv(65536)
            if not data:
                return answer, True
            answer += data
    except socket.timeout:
        return answer, False
    except ConnectionResetError:
        return answer, True


PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def test_a_request_head_that_stalls_is_answered_408_and_closed(port):
    with socket.create_connection((LOOPBACK, port), timeout=WAIT) as connection:
        started = time.perf_counter()
        connection.sendall(PARTIAL_HEAD)
        answer, closed = read_until_closed(connection, 5)
    assert closed and time.perf_counter() - started < 3
    assert answer.startswith(b"HTTP/1.1 408"), answer
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "header_timeout" and error["type"] == "timeout_error"


def test_a_connection_that_sends_nothing_is_closed(port):
    with socket.create_connection((LOOPBACK, port), timeout=WAIT) as connection:
        started = time.perf_counter()
        _, closed = read_until_closed(connection, 5)
    assert closed and time.perf_counter() - started < 3


def test_a_head_trickled_byte_by_byte_is_held_to_the_deadline_of_the_whole_head(port):
    with socket.create_connection((LOOPBACK, port), timeout=WAIT) as connection:
        started = time.perf_counter()
        closed = False
        for byte in PARTIAL_HEAD * 4:  # one byte every 0.1 s: each byte alone would reset a per-read timer
            try:
                connection.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.1)
            if time.perf_counter() - started > 3:
                break
        if not closed:
            _, closed = read_until_closed(connection, 3)
    assert closed and time.perf_counter() - started < 4


def test_a_kept_alive_connection_whose_next_head_stalls_is_closed(port):
    with socket.create_connection((LOOPBACK, port), timeout=WAIT) as connection:
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while not first.rstrip().endswith(b"}"):
            first += connection.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        started = time.perf_counter()
        connection.sendall(PARTIAL_HEAD)
        answer, closed = read_until_closed(connection, 5)
    assert closed and answer.startswith(b"HTTP/1.1 408") and time.perf_counter() - started < 3


def test_without_the_header_timeout_uvicorn_holds_a_stalled_head_open(app):
    """The guard's reason: uvicorn's own h11 protocol (keep-alive timer only) leaves the stalled head open."""
    with serving(app) as plain_port, socket.create_connection((LOOPBACK, plain_port), timeout=WAIT) as connection:
        connection.sendall(PARTIAL_HEAD)
        _, closed = read_until_closed(connection, 2 * HEADER_TIMEOUT + 1)
    assert not closed


def test_requests_whose_heads_arrive_in_time_are_served_on_one_connection(port):
    with httpx.Client(base_url=f"http://{LOOPBACK}:{port}") as client:
        for _ in range(3):
            assert client.get("/health", timeout=WAIT).status_code == 200
            time.sleep(HEADER_TIMEOUT * 1.5)  # idle between requests: uvicorn's keep-alive, not the head deadline
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=WAIT).status_code == 200


def test_a_malformed_request_gets_a_json_400(port):
    with socket.create_connection((LOOPBACK, port), timeout=WAIT) as connection:
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nbroken header line\r\n\r\n")
        answer, closed = read_until_closed(connection, 5)
    assert closed and answer.startswith(b"HTTP/1.1 400"), answer
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower()
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


def test_an_incomplete_head_over_h11_s_limit_gets_a_json_431(port):
    with socket.create_connection((LOOPBACK, port), timeout=WAIT) as connection:
        try:
            connection.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000)  # still incomplete
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer, closed = read_until_closed(connection, 5)
    assert closed and answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "headers_too_large"


def closed_with(port: int, messages) -> tuple[int, str, dict]:
    """(close code, close reason, the one error event) of a text stream sent `messages`."""
    connection = websockets_sync.connect(f"ws://{LOOPBACK}:{port}/v1/audio/speech/stream", open_timeout=WAIT,
                                         additional_headers={"Authorization": f"Bearer {API_KEY}"})
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
    errors = [event["error"] for event in events if event["type"] == "error"]
    assert len(errors) == 1, events
    return connection.close_code, connection.close_reason, errors[0]


def test_a_text_stream_outlives_the_header_timeout_and_closes_with_its_own_code_and_reason(port):
    started = time.perf_counter()
    code, reason, error = closed_with(port, [])  # never sends start: the stream's idle timeout, 1.5 s, not the head's
    assert time.perf_counter() - started > 1.4
    assert code == 4408 and reason == error["message"] and "start" in reason


def test_a_refused_text_stream_says_why_in_its_close_reason(port):
    code, reason, error = closed_with(port, ['{"type": "start", "voice": "A", "temperature": -1}'])
    assert code == 4400 and "temperature" in reason and reason == error["message"]


def test_a_close_reason_fits_a_close_frame_whole_characters_kept():
    long = "é" * 200
    reason = close_reason(long)
    assert len(reason.encode("utf-8")) <= 123 and reason.endswith("...") and reason[:-3] == "é" * 60
    assert close_reason("short") == "short" and close_reason("lone \ud800") == "lone ?"


def test_the_key_comes_from_the_option_its_file_or_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-the-file\n")
    environ = {"DRAMA3_API_KEY": "from-the-environment"}
    assert resolve_api_key("given", None, environ) == "given"
    assert resolve_api_key(None, str(key_file), environ) == "from-the-file"
    assert resolve_api_key(None, None, environ) == "from-the-environment"
    assert resolve_api_key(None, None, {}) is None
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key("given", str(key_file), environ)
    (tmp_path / "empty").write_text("\n")
    for path in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ValueError, match=f"--api-key-file {path}"):
            resolve_api_key(None, str(path), environ)


def test_drama3_serve_reads_its_key_file_header_timeout_and_aliases_and_refuses_bad_ones(monkeypatch, capsys, tmp_path):
    from transformers_drama3 import cli
    from transformers_drama3.cli import main
    from transformers_drama3.serving import app as app_module

    started = {}
    monkeypatch.setattr(app_module, "serve_in_background",
                        lambda *args, **kwargs: (started.setdefault("load", kwargs), ((lambda: None), None))[1])
    monkeypatch.setattr(app_module, "create_app", lambda get_service, settings: started.setdefault("settings", settings))
    monkeypatch.setattr(cli, "listen", lambda host, port: None)  # binds nothing
    monkeypatch.setattr(cli, "run_server", lambda app, listener, header_timeout, loading: started.setdefault(
        "run", {"header_timeout": header_timeout}))
    monkeypatch.delenv("DRAMA3_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert main(["serve", "--host", "0.0.0.0", "--api-key-file", str(key_file), "--header-timeout", "2.5",
                 "--voice-alias", "alloy=B", "--voice-alias", "echo=A", "--max-input-chars", "100",
                 "--max-body-mb", "2", "--max-text-streams", "1", "--prefill-chunk", "64"]) == 0
    assert started["load"]["prefill_chunk"] == 64
    assert started["settings"].api_key == "s3cret" and "warning" not in capsys.readouterr().err.lower()
    assert started["settings"].voice_aliases.aliases == {"alloy": "B", "echo": "A"}
    settings = started["settings"]
    assert (settings.limits.max_input_chars, settings.max_body_bytes, settings.max_text_streams) == (100, 2 * 2**20, 1)
    assert started["run"]["header_timeout"] == 2.5
    assert main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "--api-key-file" in capsys.readouterr().err
    assert main(["serve", "--header-timeout", "0"]) == 2
    assert "--header-timeout 0" in capsys.readouterr().err
    assert main(["serve", "--voice-alias", "alloy"]) == 2
    assert "--voice-alias 'alloy'" in capsys.readouterr().err
    assert main(["serve", "--max-body-mb", "0"]) == 2
    assert "--max-body-mb 0" in capsys.readouterr().err
    assert main(["serve", "--prefill-chunk", "1"]) == 2
    assert "--prefill-chunk 1" in capsys.readouterr().err
    assert main(["serve", "--voice-alias", "alloy"]) == 2
    assert "--voice-alias 'alloy'" in capsys.readouterr().err

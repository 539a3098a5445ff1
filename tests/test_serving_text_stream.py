"""The text-stream WebSocket `/v1/audio/speech/stream` on loopback, driven by a real WebSocket client
(`websockets`): text pieces in, PCM and per-chunk events out, the same audio as `model.stream_text`,
audio before the text is complete, a client that leaves cancels its stream, bad messages refused
with their field."""

import json
import time

import numpy as np
import pytest
from network_helpers import serving_on_loopback

uvicorn = pytest.importorskip("uvicorn")
websockets_sync = pytest.importorskip("websockets.sync.client")
ConnectionClosed = pytest.importorskip("websockets.exceptions").ConnectionClosed

from transformers_drama3.codec.take_audio import AudioChunk
from transformers_drama3.decoding.threads import torch_threads  # noqa: E402
from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402
from transformers_drama3.serving.audio_formats import pcm16  # noqa: E402

API_KEY = "test-key"
TEXT = "Good morning to you. The sun is up, and the birds sing. We walk to the river."
# 20 frames a chunk: more than one block of drama3-tiny's codec, which holds back 8 frames of audio
START = {"type": "start", "voice": "A", "seed": 3, "max_new_tokens": 20, "chunk_bytes": 24}
LSB = 1 / 32767


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    service = SpeechService.load(None, str(tmp_path_factory.mktemp("voices")), max_batch=4, max_queue=8)
    app = create_app(lambda: service, ServerSettings(api_key=API_KEY, request_timeout=120, max_text_streams=2))
    with serving_on_loopback(app) as port:
        yield f"ws://127.0.0.1:{port}/v1/audio/speech/stream", service, app
    service.engine.stop()


def connect(url, key=API_KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return websockets_sync.connect(url, additional_headers=headers, open_timeout=30)


def words(text):
    return [word + " " for word in text.split()]


def receive_all(connection, timeout=120):
    """Every message until the server closes: (binary audio, JSON events)."""
    audio, events = [], []
    try:
        while True:
            message = connection.recv(timeout=timeout)
            if isinstance(message, bytes):
                audio.append(message)
            else:
                events.append(json.loads(message))
    except ConnectionClosed:
        pass
    return b"".join(audio), events


def pcm_samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767


def test_text_pieces_come_back_as_pcm_and_per_chunk_events_equal_to_stream_text(server):
    url, service, _ = server
    with connect(url) as connection:
        connection.send(json.dumps(START))
        for piece in words(TEXT):
            connection.send(json.dumps({"type": "text", "text": piece}))
        connection.send(json.dumps({"type": "done"}))
        audio, events = receive_all(connection)
    kinds = [event["type"] for event in events]
    assert kinds[0] == "ready" and kinds[-1] == "done"
    assert events[0]["sample_rate"] == service.processor.sampling_rate and events[0]["seed"] == 3
    started = [event for event in events if event["type"] == "chunk.started"]
    finished = [event for event in events if event["type"] == "chunk.done"]
    assert [event["index"] for event in started] == [event["index"] for event in finished] == list(range(len(started)))
    assert len(started) >= 3 and started[-1]["look_ahead"] == ""
    assert all(event["delay"] is None or event["delay"] >= 0 for event in finished)
    assert events[-1]["frames"] == sum(event["frames"] for event in finished)

    references = service.references_of(type("Params", (), {"voice": "A", "references": []})())
    # the server decodes audio at its codec thread count; the rounding of the codec's Griffin-Lim
    # depends on it, and this thread's count is whatever the tests before left it at
    with torch_threads(service.codec_threads):
        expected = list(service.model.stream_text(
            words(TEXT), processor=service.processor, references=references, codec=service.processor.codec,
            seed=3, max_new_tokens=20, max_bytes=24,
        ))
    waveform = np.concatenate([item.audio.numpy() for item in expected if isinstance(item, AudioChunk)])
    ours, theirs = pcm_samples(audio), pcm_samples(pcm16(waveform))
    assert ours.shape == theirs.shape and ours.size > 0
    np.testing.assert_allclose(ours, theirs, atol=2 * LSB, rtol=0)


def test_first_audio_arrives_before_the_last_text_piece_is_sent(server):
    url, _, _ = server
    pieces = words(TEXT)
    with connect(url) as connection:
        connection.send(json.dumps(START))
        for piece in pieces[:-1]:
            connection.send(json.dumps({"type": "text", "text": piece}))
        message = connection.recv(timeout=120)
        while not isinstance(message, bytes):  # ready, chunk.started: the first chunk is being spoken
            message = connection.recv(timeout=120)
        assert len(message) > 0  # audio, while the last piece has not been sent
        connection.send(json.dumps({"type": "text", "text": pieces[-1]}))
        connection.send(json.dumps({"type": "done"}))
        _, events = receive_all(connection)
    assert events[-1]["type"] == "done"


def test_a_client_that_disconnects_cancels_its_stream(server):
    url, service, app = server
    cancelled = service.metrics.outcomes["cancelled"]
    connection = connect(url)
    connection.send(json.dumps({**START, "max_new_tokens": 200}))
    for piece in words(TEXT):
        connection.send(json.dumps({"type": "text", "text": piece}))
    while not isinstance(connection.recv(timeout=120), bytes):
        pass
    connection.close()  # gone mid-stream, before "done"
    deadline = time.time() + 60
    while (app.state.text_streams.active or service.metrics.outcomes["cancelled"] == cancelled) and time.time() < deadline:
        time.sleep(0.1)
    assert app.state.text_streams.active == 0
    assert service.metrics.outcomes["cancelled"] == cancelled + 1


def closed_with(url, messages, key=API_KEY):
    """Send `messages` (dicts as JSON, str as is); returns (close code, the error event)."""
    connection = connect(url, key)
    try:
        for message in messages:
            connection.send(message if isinstance(message, (str, bytes)) else json.dumps(message))
    except ConnectionClosed:
        pass  # refused before every message was sent
    _, events = receive_all(connection, timeout=60)
    code = connection.close_code
    errors = [event for event in events if event["type"] == "error"]
    assert len(errors) == 1
    return code, errors[0]["error"]


@pytest.mark.parametrize(
    "messages, code, param",
    [
        (["not json"], 4400, "messages[0]"),
        ([b"\x00\x01"], 4400, "messages[0]"),
        ([{"type": "text", "text": "hi"}], 4400, "type"),
        ([{**START, "voice": "nobody"}], 4404, "voice"),
        ([{**START, "temperature": -1}], 4400, "temperature"),
        ([{**START, "chunk_bytes": 2}], 4400, "chunk_bytes"),
        ([{**START, "response_format": "mp3"}], 4400, "response_format"),
        ([START, {"type": "text", "text": 7}], 4400, "text"),
        ([START, {"type": "text", "text": "x" * 5000}], 4413, "input"),
        ([START, {"type": "text", "text": "Hi <|im_end|> there."}, {"type": "done"}], 4400, "text"),
    ],
    ids=["not-json", "binary", "no-start", "unknown-voice", "bad-temperature", "tiny-chunks", "mp3", "non-text-piece",
         "oversized", "special-token"],
)
def test_a_bad_message_is_refused_naming_its_field(server, messages, code, param):
    url, _, app = server
    close_code, error = closed_with(url, messages)
    assert (close_code, error["param"]) == (code, param)
    assert error["message"]


def test_a_missing_api_key_is_refused(server):
    url, _, _ = server
    code, error = closed_with(url, [START], key=None)
    assert code == 4401 and error["code"] == "invalid_api_key"


def test_empty_text_is_refused_as_the_speech_endpoint_refuses_it(server):
    url, _, _ = server
    code, error = closed_with(url, [START, {"type": "text", "text": ""}, {"type": "text", "text": "  "}, {"type": "done"}])
    assert code == 4400 and error["message"] == "input: nothing to say"  # HTTP's words for a blank input

"""Fish Audio's API on a live server (loopback, drama3-tiny), driven with httpx and a WebSocket
client speaking MessagePack as Fish Audio's clients do (the clients themselves: tests/test_clients.py).

`POST /v1/tts` speaks what `/v1/audio/speech` speaks for the same request (the same engine, seed,
voice, references, speed and rate), in every format at the asked rate; `prosody.volume` is a gain;
`latency` sets the first chunk's frames; every error comes in Fish Audio's shape. `/v1/tts/live`
speaks two utterances on one socket, each flushed segment as `model.stream_text` speaks it, and
ends an utterance that fails with `finish` / `error`.
"""

import functools
import io
import json
import time

import httpx
import msgpack
import numpy as np
import pytest
import soundfile
import torch
from network_helpers import serving_on_loopback

pytest.importorskip("uvicorn")
av = pytest.importorskip("av")
websockets_sync = pytest.importorskip("websockets.sync.client")
InvalidStatus = pytest.importorskip("websockets.exceptions").InvalidStatus
ConnectionClosed = pytest.importorskip("websockets.exceptions").ConnectionClosed

from transformers_drama3.codec.take_audio import AudioChunk, WaveformStreamer  # noqa: E402
from transformers_drama3.decoding.threads import torch_threads  # noqa: E402
from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402
from transformers_drama3.serving.audio_formats import pcm16  # noqa: E402
from transformers_drama3.serving.engine import QueueFull  # noqa: E402
from transformers_drama3.tiny import shipped  # noqa: E402

KEY = "fish-key"
TEXT = "Hello there, how are you today?"
FRAMES = 40
LSB = 1 / 32767


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    service = SpeechService.load(None, str(tmp_path_factory.mktemp("voices")), max_batch=4, max_queue=8)
    app = create_app(lambda: service, ServerSettings(api_key=KEY, request_timeout=120, max_text_streams=2,
                                                     stream_idle_timeout=2, max_body_bytes=2**20))
    with serving_on_loopback(app) as port:
        yield port, service
    service.engine.stop()


def fish(port, body, key=KEY, content_type="application/msgpack", model="s2-pro", **headers):
    data = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    head = {"Authorization": f"Bearer {key}", "Content-Type": content_type, "model": model, **headers}
    return httpx.post(f"http://127.0.0.1:{port}/v1/tts", content=data, headers=head, timeout=120)


def openai_speech(port, **fields):
    body = {"input": TEXT, "voice": "A", "max_new_tokens": FRAMES, **fields}
    return httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120)


def request(**fields):
    return {"text": TEXT, "max_new_tokens": FRAMES, "references": [], "reference_id": None, "prosody": None,
            "latency": "normal", **fields}


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767


def assert_same_take(first: bytes, second: bytes) -> None:
    """Two PCM takes of the same codes: samples within 2 LSB (concurrent codec decodes may round differently)."""
    a, b = pcm(first), pcm(second)
    assert a.shape == b.shape and a.size > 0
    np.testing.assert_allclose(a, b, atol=2 * LSB, rtol=0)


def decoded(data: bytes) -> tuple[int, int]:
    """(samples, rate) of an encoded file, as a player decodes it."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        return sum(frame.samples for frame in container.decode(stream)), stream.codec_context.sample_rate


# ---- POST /v1/tts --------------------------------------------------------------------------------------


def test_fish_s_request_speaks_what_the_speech_route_speaks_for_the_same_request(server):
    port, _ = server
    ours = fish(port, request(format="pcm", sample_rate=24000, seed=5, reference_id="B"))
    theirs = openai_speech(port, response_format="pcm", sample_rate=24000, seed=5, voice="B")
    assert ours.status_code == 200 and ours.headers["content-type"] == "audio/pcm"
    assert ours.headers["x-sample-rate"] == "24000" and ours.headers["x-seed"] == "5"
    assert_same_take(ours.content, theirs.content)
    as_json = fish(port, json.dumps(request(format="pcm", sample_rate=24000, seed=5, reference_id="B")).encode(),
                   content_type="application/json")
    assert_same_take(as_json.content, theirs.content)  # Fish Audio's API takes JSON too


def test_prosody_speed_is_the_speech_route_s_time_stretch(server):
    port, _ = server
    ours = fish(port, request(format="pcm", sample_rate=16000, seed=2, prosody={"speed": 1.5, "volume": 0}))
    theirs = openai_speech(port, response_format="pcm", sample_rate=16000, seed=2, speed=1.5)
    assert_same_take(ours.content, theirs.content)
    plain = fish(port, request(format="pcm", sample_rate=16000, seed=2))
    assert len(ours.content) / len(plain.content) == pytest.approx(1 / 1.5, rel=0.02)


def test_prosody_volume_is_a_gain_in_decibels(server):
    port, _ = server
    plain = pcm(fish(port, request(format="pcm", seed=3)).content)
    louder = pcm(fish(port, request(format="pcm", seed=3, prosody={"volume": 6.0})).content)
    softer = pcm(fish(port, request(format="pcm", seed=3, prosody={"volume": -20.0})).content)
    gain = 10 ** (6 / 20)
    unclipped = np.abs(plain) * gain < 0.99
    assert plain.shape == louder.shape == softer.shape and unclipped.mean() > 0.9
    np.testing.assert_allclose(louder[unclipped], plain[unclipped] * gain, atol=3 * LSB, rtol=0)
    np.testing.assert_allclose(softer, plain * 0.1, atol=3 * LSB, rtol=0)
    assert np.abs(louder).max() <= 1.0  # past full scale it is clipped, never wrapped


def test_references_as_bytes_speak_as_the_stored_voice_of_the_same_clip(server):
    port, _ = server
    clip, transcript = shipped.reference_voice("B")
    inline = fish(port, request(format="pcm", seed=4, references=[{"audio": open(clip, "rb").read(), "text": transcript}]))
    stored = fish(port, request(format="pcm", seed=4, reference_id="B"))
    assert_same_take(inline.content, stored.content)


@functools.lru_cache(maxsize=None)
def raw_take(port: int, rate: int | None):
    """The take of seed 6 as raw pcm at `rate` (asked once per rate: the formats share it)."""
    return fish(port, request(format="pcm", sample_rate=rate, seed=6))


@pytest.mark.parametrize("fmt, rate, media", [("wav", 8000, "audio/wav"), ("wav", None, "audio/wav"),
                                              ("mp3", 32000, "audio/mpeg"), ("mp3", None, "audio/mpeg"),
                                              ("opus", None, "audio/ogg"), ("opus", 48000, "audio/ogg")])
def test_every_format_decodes_at_the_asked_rate_and_lasts_the_take(server, fmt, rate, media):
    port, _ = server
    response = fish(port, request(format=fmt, sample_rate=rate, seed=6))
    raw = raw_take(port, rate if fmt != "opus" else 48000)
    assert response.status_code == 200 and response.headers["content-type"] == media
    expected_rate = rate or {"wav": 44100, "mp3": 44100, "opus": 48000}[fmt]
    samples, decoded_rate = decoded(response.content)
    assert decoded_rate == expected_rate
    take = len(raw.content) // 2  # the same take as raw samples at that rate
    slack = {"wav": 0, "mp3": 2 * 1152, "opus": 960}[fmt]  # a coder's padding: at most two frames
    assert take <= samples <= take + slack + 960 if fmt == "opus" else abs(samples - take) <= slack


def test_mp3_and_opus_bitrates_set_the_size(server):
    port, _ = server
    small, large = (len(fish(port, request(format="mp3", seed=7, mp3_bitrate=kbps)).content) for kbps in (64, 192))
    assert large / small == pytest.approx(3, rel=0.2)
    small, large = (len(fish(port, request(format="opus", seed=7, opus_bitrate=bitrate)).content)
                    for bitrate in (12, 96000))  # kbps as the SDK sends it, bits per second as LiveKit does
    assert large / small > 3


def test_latency_sets_the_frames_of_the_first_audio_chunk_and_keeps_the_audio(server):
    _, service = server
    codec = service.processor.codec
    frames = [torch.randint(0, 64, (service.model.config.num_codebooks,)) for _ in range(40)]
    chunks = {}
    for name, first_window in (("normal", None), ("balanced", 5), ("low", 2)):
        streamer = WaveformStreamer(codec, time.perf_counter(), first_window=first_window)
        made = streamer.push(frames) + streamer.finish()
        chunks[name] = made
        assert [chunk.codes.shape[0] for chunk in made][:2] == {"normal": [10, 10], "balanced": [5, 10],
                                                               "low": [2, 10]}[name]
    whole = torch.cat([chunk.audio for chunk in chunks["normal"]])
    for name in ("balanced", "low"):
        torch.testing.assert_close(torch.cat([chunk.audio for chunk in chunks[name]]), whole, atol=1e-5, rtol=0)


def test_every_error_comes_in_fish_audio_s_shape(server, monkeypatch):
    port, service = server
    base = f"http://127.0.0.1:{port}"
    answers = {
        401: fish(port, request(), key="wrong"),
        404: fish(port, request(reference_id="nobody")),
        413: fish(port, request(text="word " * 900)),
        415: fish(port, b"{}", content_type="text/plain"),
        400: fish(port, b"\x91" * 40),
        403: fish(port, request(), Host="evil.example"),
        405: httpx.get(base + "/v1/tts", headers={"Authorization": f"Bearer {KEY}"}),
    }
    too_large = httpx.post(base + "/v1/tts", content=b"\x00" * (2**20 + 1),
                           headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/msgpack"})
    answers[413.1] = too_large
    for status, answer in answers.items():
        assert answer.status_code == int(status), answer.text
        body = answer.json()
        assert set(body) == {"status", "message"} and body["status"] == int(status) and body["message"]
    assert answers[404].json()["message"].startswith("reference_id: no voice 'nobody'")
    assert answers[400].json()["message"] == "the body: nested deeper than 32 levels"

    def busy(job):
        raise QueueFull("64 requests are waiting")

    monkeypatch.setattr(service.engine, "submit", busy)
    refused = fish(port, request())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json() == {"status": 429, "message": "the server is busy: 64 requests are waiting; retry later"}

    def broken(*args, **kwargs):
        raise RuntimeError("/secret/path exploded")

    monkeypatch.setattr(service, "job", broken)
    failed = fish(port, request())
    assert failed.status_code == 500 and set(failed.json()) == {"status", "message"}
    assert "/secret" not in failed.text
    assert openai_speech(port).json()["error"]["code"] == "internal_error"  # the OpenAI route keeps its shape


# ---- WebSocket /v1/tts/live -------------------------------------------------------------------------


def live(port, key=KEY):
    headers = {"Authorization": f"Bearer {key}", "model": "s2.1-pro"}
    return websockets_sync.connect(f"ws://127.0.0.1:{port}/v1/tts/live", additional_headers=headers, open_timeout=30)


def send(connection, event):
    connection.send(msgpack.packb(event, use_bin_type=True))


def utterance(connection, segments, **fields):
    """One utterance (start, text and flush per segment, stop): (audio bytes, the finish event, seconds
    to the first audio, seconds to the finish)."""
    started = time.perf_counter()
    send(connection, {"event": "start", "request": {"text": "", "format": "pcm", "chunk_length": 100,
                                                    "max_new_tokens": 20, "latency": "normal", **fields}})
    for segment in segments:
        send(connection, {"event": "text", "text": segment})
        send(connection, {"event": "flush"})
    send(connection, {"event": "stop"})
    audio, first = b"", None
    while True:
        event = msgpack.unpackb(connection.recv(timeout=120))
        if event["event"] == "audio":
            first = time.perf_counter() - started if first is None else first
            audio += event["audio"]
        elif event["event"] == "finish":
            return audio, event, first, time.perf_counter() - started


SEGMENTS = ["Good morning to you. ", "The sun is up, and the birds sing. "]


def test_two_utterances_on_one_socket_each_segment_spoken_as_stream_text_speaks_it(server):
    port, service = server
    rate = service.processor.sampling_rate
    with live(port) as connection:
        first, finish, _, _ = utterance(connection, SEGMENTS, seed=11, sample_rate=rate, reference_id="B")
        assert finish == {"event": "finish", "reason": "stop"}
        second, finish, _, _ = utterance(connection, SEGMENTS[:1], seed=12, sample_rate=rate)
        assert finish == {"event": "finish", "reason": "stop"}
    expected = []
    with torch_threads(service.codec_threads):
        for voice, seed, segments in (("B", 11, SEGMENTS), ("A", 12, SEGMENTS[:1])):
            references = service.references_of(type("Params", (), {"voice": voice, "references": []})())
            audio = []
            for index, segment in enumerate(segments):  # segment i: a text stream of its own, seed + i
                items = service.model.stream_text([segment], processor=service.processor, references=references,
                                                  codec=service.processor.codec, seed=seed + index, max_new_tokens=20,
                                                  max_bytes=100)
                audio += [item.audio.numpy() for item in items if isinstance(item, AudioChunk)]
            expected.append(pcm16(np.concatenate(audio)))
    assert_same_take(first, expected[0])
    assert_same_take(second, expected[1])


def test_each_utterance_is_one_stream_of_its_format_at_the_asked_rate(server):
    port, _ = server
    with live(port) as connection:
        wav, _, _, _ = utterance(connection, SEGMENTS, format="wav", sample_rate=24000, seed=1)
        mp3, _, _, _ = utterance(connection, SEGMENTS, format="mp3", sample_rate=32000, seed=1)
        raw, _, _, _ = utterance(connection, SEGMENTS, format="pcm", sample_rate=24000, seed=1)
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="int16")  # one header, then the samples
    assert rate == 24000 and audio.tobytes() == raw
    samples, rate = decoded(mp3)
    assert rate == 32000 and abs(samples / 32000 - len(raw) / 2 / 24000) < 0.1


def test_a_missing_or_wrong_key_refuses_the_handshake_in_fish_audio_s_shape(server):
    port, _ = server
    with pytest.raises(InvalidStatus) as refused:
        with live(port, key="wrong"):
            pass
    assert refused.value.response.status_code == 401
    assert json.loads(bytes(refused.value.response.body)) == {
        "status": 401, "message": "missing or wrong API key (Authorization: Bearer KEY)"}


@pytest.mark.parametrize("events, status, starts", [
    ([{"event": "start", "request": {"reference_id": "nobody"}}], 404, "reference_id: no voice 'nobody'"),
    ([{"event": "start", "request": {}}, {"event": "text", "text": "word " * 900}], 413, "text: 4500 characters"),
    ([{"event": "text", "text": "hi"}], 400, "event: 'text' before any start"),
    ([{"event": "start", "request": {}}, {"event": "shout"}], 400, "event: 'shout'"),
    ([{"event": "start", "request": {"format": "flac"}}], 400, "format: 'flac'"),
    ([{"event": "start", "request": {}}, {"event": "start", "request": {}}], 400, "event: start while"),
    ([b"\x91" * 40], 400, "events[0]: nested deeper than 32 levels"),
    (["a text frame"], 400, "events[0]: expected a binary frame"),
    ([{"event": "start", "request": {}}, {"event": "text", "text": "Hello"}], 408, "no text, flush or stop message"),
])
def test_a_failed_utterance_finishes_with_an_error_and_closes(server, events, status, starts):
    port, _ = server
    with live(port) as connection:
        for event in events:
            if isinstance(event, dict):
                send(connection, event)
            else:
                connection.send(event)
        finish = msgpack.unpackb(connection.recv(timeout=60))
        assert finish["event"] == "finish" and finish["reason"] == "error"
        assert finish["status"] == status and finish["message"].startswith(starts), finish
        with pytest.raises(ConnectionClosed) as closed:
            connection.recv(timeout=30)
    assert closed.value.rcvd.code == 4000 + status

"""Fish Audio's own clients, installed from PyPI into the client packages' environment (`.ci/envs.py`
"clients": fish-audio-sdk, livekit-plugins-fishaudio), driving a live `drama3 serve` (drama3-tiny, on
loopback, with an API key) by their base URL alone, through their own APIs: the SDK's
`tts.convert`, `tts.stream` and `tts.stream_websocket`, its legacy client's `Session.tts` (read as it
streams, and in asyncio) and `WebSocketSession.tts`; LiveKit's `synthesize()` in wav, pcm and mp3,
and `stream()` speaking two utterances on one socket (the drivers: tests/client_drivers/).

Each call is matched to the take the server logged for it, in order, and must have: no error, the
audio as the client plays it (decoded, or pcm at the rate the call asked for) at the asked rate,
lasting what the take lasts within 2%, its first audio before the take ended where the client
streams, and the voice it asked for. Errors arrive as each client's own typed exceptions.
"""

import logging

import pytest
from env_helpers import environment
from network_helpers import LOOPBACK, serving_on_loopback
from test_clients import LONG, SHORT, TOLERANCE, Server, drive

pytest.importorskip("uvicorn")
pytest.importorskip("msgpack")

from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402

pytestmark = pytest.mark.slow  # subprocesses in an environment of their own

KEY = "fish-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server `drama3 serve` runs (drama3-tiny, with a key), in this process on loopback (a
    subprocess would spend ~20 s importing and loading what this process has), its request log
    (`--log-requests`'s lines) written to a file. Not warmed: the first call (the SDK's
    `tts.convert`, which reads the whole response) pays the first forward's set-up, and no
    first-audio time is asked of it."""
    folder = tmp_path_factory.mktemp("fish-clients")
    log = folder / "serve.log"
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("drama3 serve: %(message)s"))
    request_log = logging.getLogger("transformers_drama3.serving.requests")
    level = request_log.level
    request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    service = SpeechService.load(None, str(folder / "voices"), max_batch=2)
    try:
        with serving_on_loopback(create_app(lambda: service, ServerSettings(api_key=KEY))) as port:
            yield Server(f"http://{LOOPBACK}:{port}", log)
    finally:
        service.engine.stop()
        request_log.removeHandler(handler)
        request_log.setLevel(level)
        handler.close()


@pytest.fixture(scope="module")
def clients_python():
    return environment("clients")


def check_takes(server: Server, before: int, calls: list[dict], expected: list[dict]) -> list[dict]:
    """Each successful call against the take it made (the takes after the first `before`, in order):
    `expected` per call: the voice, the rate asked, whether the client streams."""
    takes = server.takes()[before:]
    assert len(takes) == len(calls), (calls, takes)
    for call, take, wanted in zip(calls, takes, expected):
        assert call["errors"] == [], call
        assert take["voice"] == wanted["voice"], (call, take)
        assert call["rate"] == wanted["rate"] == int(take["rate"]), (call, take)  # played at the rate it asked for
        played = call["samples"] / call["rate"]
        assert abs(played - float(take["audio"])) <= TOLERANCE * float(take["audio"]), (call, take)
        if wanted["streams"]:
            assert call["first_audio"] < float(take["total"]), (call, take)  # it arrived while the take was made
    return takes


def test_fish_audio_s_sdk_both_clients_every_format_and_transport(server, clients_python):
    before = len(server.takes())
    pieces = ["Good morning to you all, ", "and welcome home."]
    calls = [
        {"api": "convert", "text": LONG},  # the SDK's defaults: mp3 at Fish Audio's 44.1 kHz, the default voice
        {"api": "convert", "text": SHORT, "format": "opus", "reference_id": "B"},
        {"api": "stream", "text": SHORT, "format": "pcm", "sample_rate": 16000, "reference_id": "B"},
        {"api": "websocket", "pieces": pieces, "format": "wav", "sample_rate": 24000, "speed": 1.25},
        {"api": "legacy", "text": SHORT, "format": "wav", "sample_rate": 22050, "reference_id": "B"},
        {"api": "legacy_async", "text": SHORT, "format": "pcm", "sample_rate": 24000},
        {"api": "legacy_websocket", "pieces": pieces, "format": "pcm", "sample_rate": 16000, "reference_id": "B"},
    ]
    errors = [
        {"api": "convert", "text": SHORT, "key": "wrong"},
        {"api": "stream", "text": SHORT, "reference_id": "nobody"},
        {"api": "websocket", "pieces": pieces, "reference_id": "nobody"},
        {"api": "legacy", "text": SHORT, "key": "wrong"},
        {"api": "legacy_websocket", "pieces": pieces, "reference_id": "nobody"},
    ]
    report = drive(clients_python, "fish_sdk_driver.py", {"base_url": server.base, "key": KEY, "calls": calls + errors})
    spoken, refused = report["calls"][:len(calls)], report["calls"][len(calls):]
    expected = [{"voice": "A", "rate": 44100, "streams": False}, {"voice": "B", "rate": 48000, "streams": False},
                {"voice": "B", "rate": 16000, "streams": False}, {"voice": "A", "rate": 24000, "streams": True},
                {"voice": "B", "rate": 22050, "streams": True}, {"voice": "A", "rate": 24000, "streams": False},
                {"voice": "B", "rate": 16000, "streams": True}]
    takes = check_takes(server, before, spoken, expected)
    assert [take["format"] for take in takes] == ["mp3", "opus", "pcm", "wav", "wav", "pcm", "pcm"]
    assert [take["speed"] for take in takes] == ["1", "1", "1", "1.25", "1", "1", "1"]
    assert [(call["exception"], call["status"]) for call in refused] == [
        ("fishaudio.exceptions.AuthenticationError", 401),
        ("fishaudio.exceptions.NotFoundError", 404),
        ("fishaudio.exceptions.WebSocketError", None),
        ("fish_audio_sdk.exceptions.HttpCodeErr", 401),
        ("fish_audio_sdk.exceptions.WebSocketErr", None),
    ], refused
    assert "no voice 'nobody'" in refused[1]["errors"][0]  # the SDK read Fish Audio's error body


def test_livekit_s_fish_audio_plugin_synthesizes_every_format_and_streams_two_utterances_on_one_socket(
        server, clients_python):
    before = len(server.takes())
    calls = [
        {"mode": "synthesize", "text": SHORT},  # the plugin's defaults: wav at 24 kHz, Fish Audio's default voice id
        {"mode": "synthesize", "text": SHORT, "output_format": "pcm", "voice_id": "B"},
        {"mode": "synthesize", "text": LONG, "output_format": "mp3"},  # 32 kHz, the plugin's rate for mp3
        {"mode": "stream", "voice_id": "B", "output_format": "pcm",
         "utterances": ["Good morning. Welcome home.", SHORT]},  # two sentences: a flush after each
        {"mode": "synthesize", "text": SHORT, "key": "wrong"},
        {"mode": "stream", "utterances": [SHORT], "key": "wrong"},
    ]
    report = drive(clients_python, "livekit_fish_driver.py", {"base_url": server.base, "key": KEY, "calls": calls})
    spoken = [utterance for call in report["calls"][:4] for utterance in call["utterances"]]
    expected = [{"voice": "A", "rate": 24000, "streams": True}, {"voice": "B", "rate": 24000, "streams": True},
                {"voice": "A", "rate": 32000, "streams": True}, {"voice": "B", "rate": 24000, "streams": True},
                {"voice": "B", "rate": 24000, "streams": True}]
    takes = check_takes(server, before, spoken, expected)
    assert [take["format"] for take in takes] == ["wav", "pcm", "mp3", "pcm", "pcm"]
    assert report["calls"][3]["connections"] == 1  # both utterances of stream() on one socket
    refused = [call["utterances"][0] for call in report["calls"][4:]]
    assert [(call["exception"], call["status"]) for call in refused] == [("APIStatusError", 401)] * 2, refused

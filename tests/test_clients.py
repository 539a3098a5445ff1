"""The clients voice apps are built with, installed from PyPI into environments of their own
(`.ci/envs.py`: pipecat-ai[openai], livekit-agents + livekit-plugins-openai, litellm and the openai
SDK in one; wyoming-openai, which needs Python >= 3.12, in another), each driving a live
`drama3 serve` (drama3-tiny, on loopback) through its own API: pipecat's `run_test` harness,
LiveKit's `synthesize` and `stream`, the Wyoming protocol's `Describe` and `Synthesize` against
wyoming-openai's server process, `litellm.speech`, the SDK's streamed `audio.speech.create`
(the drivers: tests/client_drivers/).

The server logs each take (`--log-requests`: the voice that spoke, the audio it sent, when the take
ended); each call is matched to its take, in order, and must have: no error, the audio as the
client plays it (its samples at the rate the client believes) lasting what the take lasts within
2%, its first audio before the take ended (litellm.speech returns the whole take, so not there), the
client's default voice speaking the server's default voice (A), and each of drama3's voices
(A, B) chosen by the client's own voice setting.
"""

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from env_helpers import bare_environment, environment
from network_helpers import LOOPBACK, free_port, wait_for_health

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.slow  # subprocesses in environments of their own

DRIVERS = Path(__file__).resolve().parent / "client_drivers"
SHORT = "Good morning to you all, and welcome home."
LONG = "The river ran past the old mill, and the miller's children watched the boats go slowly by."
"""A take of about 9 s on drama3-tiny (8.8-15 s over four seeds): an mp3 coder's padding (at most two
frames, 0.1 s) stays under 2% of it, and sent whole it would outlast pipecat's 3 s wait for audio. A
short take (1.5 s to make) leaves too little room to tell streamed audio from audio sent whole."""
ALIASES = ("nova=B", "echo=A")
"""pipecat sends only OpenAI's voice names: the operator maps them onto drama3's voices."""
TOLERANCE = 0.02
TAKE_LINE = re.compile(r"drama3 serve: speech (?P<id>\S+) voice=(?P<voice>\S+) seed=\d+ format=(?P<format>\S+) "
                       r"rate=(?P<rate>\d+) speed=(?P<speed>\S+) frames=\d+ audio=(?P<audio>[\d.]+)s first_audio=\S+ "
                       r"total=(?P<total>[\d.]+)s finish=(?P<finish>\S+)")


@dataclass
class Server:
    base: str
    log: Path

    def takes(self) -> list[dict]:
        """The takes logged so far, in the order they ended."""
        lines = self.log.read_text(errors="replace").splitlines()
        return [match.groupdict() for match in map(TAKE_LINE.search, lines) if match]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`drama3 serve` (drama3-tiny) in a subprocess on loopback, logging its takes, warmed by one take."""
    folder = tmp_path_factory.mktemp("clients")
    port, log = free_port(), folder / "serve.log"
    command = [sys.executable, "-m", "transformers_drama3.cli", "serve", "--host", LOOPBACK, "--port", str(port),
               "--voices-dir", str(folder / "voices"), "--max-batch", "2", "--log-requests",
               *(flag for alias in ALIASES for flag in ("--voice-alias", alias))]
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, env={**os.environ, "DRAMA3_API_KEY": ""}, stdout=sink, stderr=sink)
    base = f"http://{LOOPBACK}:{port}"
    try:
        wait_for_health(base, process)
        warm = httpx.post(base + "/v1/audio/speech", json={"input": SHORT, "response_format": "pcm"}, timeout=300)
        assert warm.status_code == 200, warm.text  # the first take pays the first forward's set-up
        yield Server(base + "/v1", log)
    finally:
        process.terminate()
        process.wait(timeout=30)


def drive(python: str, driver: str, request: dict) -> dict:
    """A driver's report (tests/client_drivers/), run by an environment's Python."""
    environment_variables = bare_environment(LITELLM_LOCAL_MODEL_COST_MAP="True")  # litellm: no price-list download
    done = subprocess.run([python, str(DRIVERS / driver), json.dumps(request)], capture_output=True, text=True,
                          timeout=900, cwd=DRIVERS, env=environment_variables)
    assert done.returncode == 0, f"{driver} failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_calls(server: Server, before: int, calls: list[dict], voices: list[str], streamed: bool = True) -> list[dict]:
    """Each call against the take it made (the takes after the first `before`, in order)."""
    takes = server.takes()[before:]
    assert len(takes) == len(calls), (calls, takes)
    for call, take, voice in zip(calls, takes, voices):
        assert call["errors"] == [], call
        assert take["voice"] == voice, (call, take)
        played = call["samples"] / call["rate"]
        assert abs(played - float(take["audio"])) <= TOLERANCE * float(take["audio"]), (call, take)
        if streamed:
            assert call["first_audio"] < float(take["total"]), (call, take)  # it arrived while the take was made
        if call.get("request_ids") and call["request_ids"][0].startswith("req_"):
            assert call["request_ids"] == [take["id"]]  # the client saw the server's x-request-id
    return takes


@pytest.fixture(scope="module")
def clients_python():
    return environment("clients")


def test_pipecat_speaks_through_its_own_test_harness(server, clients_python):
    before = len(server.takes())
    request = {"base_url": server.base, "calls": [{"voice": None, "text": LONG}, {"voice": "nova", "text": SHORT},
                                                  {"voice": "echo", "text": LONG, "speed": 1.5}]}
    report = drive(clients_python, "pipecat_driver.py", request)
    assert [call["voice"] for call in report["calls"]] == ["alloy", "nova", "echo"]  # alloy: pipecat's default
    assert all(call["rate"] == 24000 for call in report["calls"])  # what pipecat labels its frames
    takes = check_calls(server, before, report["calls"], ["A", "B", "A"])
    assert [take["speed"] for take in takes] == ["1", "1", "1.5"]


def test_livekit_synthesize_and_stream(server, clients_python):
    before = len(server.takes())
    request = {"base_url": server.base, "calls": [
        {"mode": "synthesize", "text": LONG},  # LiveKit's defaults: voice ash, mp3 over SSE
        {"mode": "synthesize", "voice": "B", "response_format": "pcm", "text": SHORT},
        {"mode": "stream", "voice": "A", "text": LONG},  # an agent session's path: the StreamAdapter
        {"mode": "synthesize", "voice": "A", "response_format": "pcm", "speed": 1.5, "text": SHORT},
    ]}
    report = drive(clients_python, "livekit_driver.py", request)
    assert report["calls"][0]["voice"] == "ash"
    takes = check_calls(server, before, report["calls"], ["A", "B", "A", "A"])
    assert [take["format"] for take in takes] == ["mp3", "pcm", "mp3", "pcm"]
    assert [take["speed"] for take in takes] == ["1", "1", "1", "1.5"]


def test_home_assistant_s_wyoming_bridge_lists_and_speaks_drama3_s_voices(server):
    python = environment("wyoming")
    before = len(server.takes())
    request = {"base_url": server.base, "port": free_port(),
               "calls": [{"voice": None, "text": SHORT}, {"voice": "A", "text": SHORT}, {"voice": "B", "text": SHORT}]}
    report = drive(python, "wyoming_driver.py", request)
    assert report["settings"] == {"TTS_OPENAI_URL": server.base, "TTS_MODELS": "drama3-tiny"}  # the Clients guide's two
    assert report["voices"] == ["A", "B"]  # drama3's voices, listed by the bridge's own discovery
    takes = check_calls(server, before, report["calls"], ["A", "A", "B"])
    assert {take["format"] for take in takes} == {"wav"}


def test_litellm_speech(server, clients_python):
    before = len(server.takes())
    request = {"base_url": server.base, "calls": [{"voice": "alloy", "text": LONG},  # OpenAI's default voice, mp3
                                                  {"voice": "A", "text": SHORT, "response_format": "pcm"},
                                                  {"voice": "B", "text": SHORT, "response_format": "pcm"}]}
    report = drive(clients_python, "litellm_driver.py", request)
    check_calls(server, before, report["calls"], ["A", "A", "B"], streamed=False)  # litellm returns whole takes


def test_the_openai_sdk_streams_speech(server, clients_python):
    before = len(server.takes())
    request = {"base_url": server.base, "calls": [{"voice": "alloy", "text": SHORT, "response_format": "pcm"},
                                                  {"voice": "B", "text": LONG, "stream_format": "sse"},
                                                  {"voice": "A", "text": SHORT, "response_format": "wav"}]}
    report = drive(clients_python, "openai_driver.py", request)
    takes = check_calls(server, before, report["calls"], ["A", "B", "A"])
    assert [take["format"] for take in takes] == ["pcm", "mp3", "wav"]  # SSE without response_format: mp3

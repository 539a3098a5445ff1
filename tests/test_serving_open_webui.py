"""Open WebUI's "openai" TTS engine against `drama3 serve` (a subprocess on loopback, drama3-tiny,
started with a key file and `--open-listings`), call for call as Open WebUI makes them
(backend/open_webui/routers/audio.py and src/lib/apis/audio/index.ts of open-webui/open-webui):

- it lists with plain `requests.get(f"{base}/audio/models")`, `.../audio/voices` (and, in 0.12, a
  `{base}/models` fallback): no Authorization header, so with a key the listings must be left open;
  it reads `data["models"]` as `[{"id"}]` and `{voice["id"]: voice["name"] for voice in data["voices"]}`;
- it speaks with `POST {base}/audio/speech`, headers `Content-Type: application/json` and
  `Authorization: Bearer <its TTS key>`, the JSON body its page sent (`{"input", "voice"}`) with
  `"model"` set to its TTS model, no `response_format`: OpenAI's default, mp3, which it caches as
  a `.mp3` file. Its defaults are the voice `alloy` and the model `tts-1`.
"""

import io
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
from network_helpers import LOOPBACK, free_port, wait_for_health

pytest.importorskip("uvicorn")
av = pytest.importorskip("av")

KEY = "open-webui-key"
WAIT = 60


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """`drama3 serve` in a subprocess: its key in a file, the listings open; yields its OpenAI base URL."""
    folder = tmp_path_factory.mktemp("open-webui")
    key_file = folder / "key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    environment = {**os.environ, "DRAMA3_API_KEY": ""}
    command = [sys.executable, "-m", "transformers_drama3.cli", "serve", "--host", LOOPBACK, "--port", str(port),
               "--api-key-file", str(key_file), "--open-listings", "--voices-dir", str(folder / "voices"),
               "--max-batch", "2", "--threads", "1"]
    server = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_for_health(url, server)
        yield url + "/v1"
    finally:
        server.terminate()
        server.wait(timeout=30)


def open_webui_speech(base: str, voice: str, model: str) -> httpx.Response:
    """Open WebUI's `POST {base}/audio/speech`: its page's body, `model` set, its two headers."""
    payload = {"input": "Hello there, how are you today?", "voice": voice}
    payload["model"] = model
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    return httpx.post(f"{base}/audio/speech", json=payload, headers=headers, timeout=WAIT)


def test_open_webui_lists_models_and_voices_without_the_key(base):
    models = httpx.get(f"{base}/audio/models", timeout=WAIT)
    assert models.status_code == 200
    ids = [model["id"] for model in models.json().get("models", [])]
    assert ids[0] == "drama3-tiny" and "tts-1" in ids  # its default model is listed, and accepted
    fallback = httpx.get(f"{base}/models", timeout=WAIT)
    assert fallback.status_code == 200 and fallback.json()["data"][0]["id"] == "drama3-tiny"
    voices = httpx.get(f"{base}/audio/voices", timeout=WAIT)
    assert voices.status_code == 200
    available = {voice["id"]: voice["name"] for voice in voices.json().get("voices", [])}
    assert {"A": "A", "B": "B"}.items() <= available.items()


def test_open_webui_cannot_speak_or_change_voices_without_the_key(base):
    assert httpx.post(f"{base}/audio/speech", json={"input": "Hi.", "voice": "A"}, timeout=WAIT).status_code == 401
    assert httpx.delete(f"{base}/audio/voices/A", timeout=WAIT).status_code == 401


def decoded(data: bytes, rate: int) -> tuple[np.ndarray, int, str]:
    """An encoded file -> (its samples as float32 at `rate`, its coded rate, its codec)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        frames = [out.to_ndarray().reshape(-1) for frame in container.decode(stream) for out in resampler.resample(frame)]
        frames += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
        return np.concatenate(frames), stream.codec_context.sample_rate, stream.codec_context.name


def aligned_correlation(reference: np.ndarray, coded: np.ndarray, max_lag: int = 4096) -> float:
    best = -1.0
    for lag in range(max_lag + 1):
        n = min(reference.size, coded.size - lag)
        if n < reference.size // 2:
            break
        a, b = reference[:n] - reference[:n].mean(), coded[lag:lag + n] - coded[lag:lag + n].mean()
        best = max(best, float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12)))
    return best


@pytest.mark.parametrize("voice, model", [("A", "drama3-tiny"), ("alloy", "tts-1"), ("B", "gpt-4o-mini-tts")],
                         ids=["listed-voice", "open-webui-defaults", "another-model-name"])
def test_open_webui_gets_an_mp3_of_the_take(base, voice, model):
    answer = open_webui_speech(base, voice, model)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "audio/mpeg"
    rate, seed = int(answer.headers["x-sample-rate"]), int(answer.headers["x-seed"])
    # the take itself: the same request as 16-bit PCM at the seed the server drew
    spoken = "A" if voice == "alloy" else voice  # an unaliased preset speaks with the default voice, A
    take = httpx.post(f"{base}/audio/speech", headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT,
                      json={"input": "Hello there, how are you today?", "voice": spoken, "seed": seed,
                            "response_format": "pcm", "sample_rate": rate})
    reference = np.frombuffer(take.content, dtype="<i2").astype(np.float32) / 32767
    audio, coded_rate, codec = decoded(answer.content, rate)
    assert codec.startswith("mp3") and coded_rate == rate
    assert abs(audio.size - reference.size) / rate < 0.11  # streamed: LAME's padding, at most two frames
    assert aligned_correlation(reference, audio) > 0.9


def test_an_unknown_voice_is_refused_with_a_json_error_open_webui_can_show(base):
    answer = open_webui_speech(base, "nobody", "tts-1")
    assert answer.status_code == 404
    error = answer.json()["error"]  # Open WebUI shows f"External: {res['error']}"
    assert "nobody" in error["message"] and error["param"] == "voice"

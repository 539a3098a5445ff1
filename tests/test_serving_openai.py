"""OpenAI's names and formats on the live server (issue 47): preset voice names speak (an operator's
alias, else the default voice) and unknown names are still refused; the model listings name what
is accepted; every response format decodes back (with PyAV) to the take."""

import json

import httpx
import numpy as np
import pytest
import soundfile
from network_helpers import serving_on_loopback

pytest.importorskip("uvicorn")

from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402
from transformers_drama3.serving.openai_names import (  # noqa: E402
    OPENAI_SPEECH_MODELS,
    OPENAI_VOICES,
    VoiceAliases,
)
from transformers_drama3.serving.voices import VoiceReference  # noqa: E402
from transformers_drama3.tiny import shipped  # noqa: E402

API_KEY = "openai-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
WAIT = 60
FRAMES = 12


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    service = SpeechService.load(None, str(tmp_path_factory.mktemp("voices")), max_batch=4, max_queue=8)
    yield service
    service.engine.stop()


@pytest.fixture(scope="module")
def base(service):
    aliases = VoiceAliases.from_specs(["alloy=B", "narrator=B", "ghost=nobody"])
    app = create_app(lambda: service, ServerSettings(api_key=API_KEY, voice_aliases=aliases))
    with serving_on_loopback(app) as port:
        yield f"http://127.0.0.1:{port}"


def pcm(base: str, voice, seed: int = 5, **fields) -> httpx.Response:
    body = {"model": "tts-1", "input": "Hello there.", "voice": voice, "response_format": "pcm", "seed": seed,
            "max_new_tokens": FRAMES, **fields}
    return httpx.post(base + "/v1/audio/speech", json=body, headers=HEADERS, timeout=WAIT)


def test_the_preset_voices_are_openai_s():
    openai = pytest.importorskip("openai")
    import typing

    from openai.types.audio import speech_create_params

    literal = [arg for arg in typing.get_args(speech_create_params.Voice) if typing.get_origin(arg) is typing.Literal]
    assert set(OPENAI_VOICES) == set(typing.get_args(literal[0])), openai.__version__


def test_an_aliased_preset_speaks_its_voice_and_an_unaliased_one_the_default(base):
    as_b, b = pcm(base, "alloy"), pcm(base, "B")
    assert as_b.status_code == 200 and as_b.content == b.content
    as_default, a = pcm(base, "echo"), pcm(base, "A")  # drama3-tiny's default voice is A
    assert as_default.status_code == 200 and as_default.content == a.content
    assert a.content != b.content
    assert pcm(base, {"id": "narrator"}).content == b.content  # OpenAI's custom-voice spelling, an operator's alias


def test_a_stored_voice_wins_over_a_preset_of_its_name(base, service):
    clip, transcript = shipped.reference_voice("B")
    samples, rate = soundfile.read(clip, dtype="float32")
    service.voices.add("shimmer", [VoiceReference(samples, rate, transcript, 0)], "shimmer")
    try:
        assert pcm(base, "shimmer").content == pcm(base, "B").content
    finally:
        service.voices.delete("shimmer")


@pytest.mark.parametrize("voice", ["nobody", "Alloy", "alloy2"])
def test_a_name_that_is_neither_stored_nor_a_preset_is_refused_404(base, voice):
    refused = pcm(base, voice)
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "voice"
    assert refused.json()["error"]["code"] == "voice_not_found"


def test_an_alias_of_a_voice_that_is_not_stored_is_refused_naming_both(base):
    refused = pcm(base, "ghost")
    assert refused.status_code == 404
    message = refused.json()["error"]["message"]
    assert "ghost" in message and "nobody" in message


def test_a_text_stream_accepts_a_preset_voice(base):
    websockets_sync = pytest.importorskip("websockets.sync.client")
    with websockets_sync.connect(base.replace("http", "ws") + "/v1/audio/speech/stream", additional_headers=HEADERS,
                                 open_timeout=WAIT) as connection:
        connection.send(json.dumps({"type": "start", "voice": "alloy", "max_new_tokens": 4}))
        assert json.loads(connection.recv(timeout=WAIT))["type"] == "ready"


def test_the_listings_name_the_served_model_and_openai_s_names_as_its_aliases(base):
    models = httpx.get(base + "/v1/models", headers=HEADERS, timeout=WAIT).json()["data"]
    assert models[0]["id"] == "drama3-tiny" and "alias_of" not in models[0]
    assert [model["id"] for model in models[1:]] == list(OPENAI_SPEECH_MODELS)
    assert {model["alias_of"] for model in models[1:]} == {"drama3-tiny"}
    audio_models = httpx.get(base + "/v1/audio/models", headers=HEADERS, timeout=WAIT).json()["models"]
    assert audio_models == [{"id": model["id"]} for model in models]
    voices = httpx.get(base + "/v1/audio/voices", headers=HEADERS, timeout=WAIT).json()
    assert {"alias": "alloy", "voice": "B"} in voices["aliases"]


@pytest.mark.parametrize("spec", ["alloy", "=A", "alloy=", "alloy=A,alloy=B"])
def test_a_malformed_or_repeated_alias_is_refused_naming_it(spec):
    with pytest.raises(ValueError, match="--voice-alias"):
        VoiceAliases.from_specs(spec.split(","))

"""Fine-tuned voices over HTTP: `drama3 serve --adapter NAME=PATH` serves a LoRA adapter as voice NAME
to the official openai client (the take is the PEFT-merged model's), the WebSocket stream speaks
with it, `POST /v1/audio/voices` registers one (upload, or a server path under the allowed root)
and refuses a bad one naming what is wrong, `DELETE` unloads it."""

from __future__ import annotations

import base64
import copy
import json

import httpx
import numpy as np
import pytest
import torch

from network_helpers import serving_on_loopback
from transformers_drama3.serving.adapter_layers import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE, base_fingerprint
from transformers_drama3.serving.audio_formats import pcm16
from transformers_drama3.training.lora import apply_lora

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
websockets_sync = pytest.importorskip("websockets.sync.client")
ConnectionClosed = pytest.importorskip("websockets.exceptions").ConnectionClosed

from transformers_drama3.codec.take_audio import AudioChunk  # noqa: E402
from transformers_drama3.decoding.threads import torch_threads  # noqa: E402
from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402
from transformers_drama3.serving.protocol import Limits, parse_speech  # noqa: E402

API_KEY = "test-key"
FRAMES = 16
LSB = 1 / 32767
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def write_adapter(base, folder, seed: int, scale: float = 0.05):
    """A "light" adapter of drama3-tiny with non-trivial weights; returns the PEFT model."""
    peft = apply_lora(copy.deepcopy(base), "light", r=4)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in peft.named_parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale)
    peft.save_pretrained(folder)
    (folder / BASE_FILE).write_text(json.dumps(base_fingerprint(base.config)))
    return peft


@pytest.fixture(scope="module")
def server(tmp_path_factory, bundled_tiny):
    base, _ = bundled_tiny
    root = tmp_path_factory.mktemp("adapters")
    merged = {}
    for name, seed in (("calm", 1), ("bright", 2), ("spare", 3)):
        merged[name] = write_adapter(base, root / name, seed).merge_and_unload().eval()
        merged[name].set_experts_implementation("eager")
        merged[name].double()
    service = SpeechService.load(None, str(tmp_path_factory.mktemp("voices")), max_batch=8, max_queue=16,
                                 adapter_specs=[f"calm={root / 'calm'}"], adapter_root=str(root), max_adapters=2,
                                 adapter_rank=8)
    service.model.set_experts_implementation("eager")  # float64: see test_serving_http
    service.model.double()
    app = create_app(lambda: service, ServerSettings(api_key=API_KEY, request_timeout=120))
    with serving_on_loopback(app) as port:
        yield f"http://127.0.0.1:{port}", service, merged, root
    service.engine.stop()


def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


def expected_pcm(service, model, body: dict) -> np.ndarray:
    """What `model` says for a speech request body, alone, through the service's own prompt and codec."""
    params = parse_speech(body, Limits(), service.has_voice)
    job = service.job(params, None)
    settings = job.settings
    out = model.generate(job.input_ids, job.audio_codes, seed=job.seed, max_new_tokens=job.max_new_tokens,
                         do_sample=settings.do_sample, temperature=settings.temperature, top_p=settings.top_p,
                         top_k=settings.top_k, return_dict_in_generate=True)
    codes = out.audio_codes[0, : int(out.lengths[0])]
    return pcm_samples(pcm16(service.waveform(codes))), codes


def pcm_samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767


def test_the_openai_client_speaks_an_adapter_voice_as_the_merged_model_does(server):
    base_url, service, merged, _ = server
    text = "The river runs past the old mill."
    response = client(server).audio.speech.create(model="drama3-tiny", input=text, voice="calm", response_format="pcm",
                                                  extra_body={"seed": 5, "max_new_tokens": FRAMES,
                                                              "sample_rate": service.processor.sampling_rate})
    body = {"model": "drama3-tiny", "input": text, "voice": "calm", "seed": 5, "max_new_tokens": FRAMES}
    expected, codes = expected_pcm(service, merged["calm"], body)
    ours = pcm_samples(response.content)
    assert ours.shape == expected.shape and ours.size > 0
    np.testing.assert_allclose(ours, expected, atol=2 * LSB, rtol=0)
    _, base_codes = expected_pcm(service, service.model, body)  # no routing: the base model
    assert not torch.equal(codes, base_codes), "the adapter must change the take"


def test_the_voice_list_names_adapter_voices(server):
    listing = httpx.get(server[0] + "/v1/audio/voices", headers=HEADERS).json()["voices"]
    by_id = {voice["id"]: voice for voice in listing}
    assert by_id["calm"]["adapter"] is True and "adapter" not in by_id["A"]


def test_the_websocket_stream_speaks_with_an_adapter_voice(server):
    base_url, service, merged, _ = server
    url = base_url.replace("http", "ws") + "/v1/audio/speech/stream"
    pieces = [word + " " for word in "Good morning to you. The sun is up.".split()]
    start = {"type": "start", "voice": "calm", "seed": 3, "max_new_tokens": FRAMES, "chunk_bytes": 24}
    audio = []
    with websockets_sync.connect(url, additional_headers=HEADERS, open_timeout=30) as connection:
        connection.send(json.dumps(start))
        for piece in pieces:
            connection.send(json.dumps({"type": "text", "text": piece}))
        connection.send(json.dumps({"type": "done"}))
        try:
            while True:
                message = connection.recv(timeout=120)
                if isinstance(message, bytes):
                    audio.append(message)
        except ConnectionClosed:
            pass
    with torch_threads(service.codec_threads):
        expected = list(merged["calm"].stream_text(pieces, processor=service.processor, references=(),
                                                   codec=service.processor.codec, seed=3, max_new_tokens=FRAMES,
                                                   max_bytes=24))
    waveform = np.concatenate([item.audio.numpy() for item in expected if isinstance(item, AudioChunk)])
    ours, theirs = pcm_samples(b"".join(audio)), pcm_samples(pcm16(waveform))
    assert ours.shape == theirs.shape and ours.size > 0
    np.testing.assert_allclose(ours, theirs, atol=2 * LSB, rtol=0)
    assert all(entry.leases == 0 for entry in service.adapters._entries.values())


def upload(root, name: str) -> dict:
    folder = root / name
    return {
        ADAPTER_CONFIG: json.loads((folder / ADAPTER_CONFIG).read_text()),
        ADAPTER_WEIGHTS: base64.b64encode((folder / ADAPTER_WEIGHTS).read_bytes()).decode(),
    }


def test_an_uploaded_adapter_speaks_and_delete_unloads_it(server):
    base_url, service, merged, root = server
    created = httpx.post(base_url + "/v1/audio/voices", headers=HEADERS, json={"id": "up", "adapter": upload(root, "bright")})
    assert created.status_code == 200, created.text
    body = {"model": "drama3-tiny", "input": "One, two, three.", "voice": "up", "seed": 2, "max_new_tokens": FRAMES,
            "response_format": "pcm", "sample_rate": service.processor.sampling_rate}
    response = httpx.post(base_url + "/v1/audio/speech", headers=HEADERS, json=body, timeout=120)
    assert response.status_code == 200, response.text
    expected, _ = expected_pcm(service, merged["bright"], body)
    np.testing.assert_allclose(pcm_samples(response.content), expected, atol=2 * LSB, rtol=0)
    assert httpx.delete(base_url + "/v1/audio/voices/up", headers=HEADERS).status_code == 200
    gone = httpx.post(base_url + "/v1/audio/speech", headers=HEADERS, json=body, timeout=120)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "voice"
    assert "up" not in service.adapters and not (service.adapters.storage / "up").exists()


def test_a_server_path_is_read_only_under_the_allowed_root(server):
    base_url, service, _, root = server
    inside = httpx.post(base_url + "/v1/audio/voices", headers=HEADERS, json={"id": "spare", "adapter": {"path": "spare"}})
    assert inside.status_code == 200, inside.text
    for path in ("..", "/etc", "spare/../.."):
        refused = httpx.post(base_url + "/v1/audio/voices", headers=HEADERS, json={"id": "far", "adapter": {"path": path}})
        assert refused.status_code == 403 and "outside" in refused.json()["error"]["message"], path
    assert "far" not in service.adapters
    assert httpx.delete(base_url + "/v1/audio/voices/spare", headers=HEADERS).status_code == 200
    assert (root / "spare" / ADAPTER_WEIGHTS).exists(), "a server path is only read, never removed"


def test_a_corrupt_upload_is_refused_naming_the_file_and_nothing_is_registered(server):
    base_url, service, _, root = server
    files = upload(root, "bright")
    files[ADAPTER_WEIGHTS] = base64.b64encode(b"\x00" * 100).decode()
    before = httpx.get(base_url + "/v1/audio/voices", headers=HEADERS).json()["voices"]
    refused = httpx.post(base_url + "/v1/audio/voices", headers=HEADERS, json={"id": "broken", "adapter": files})
    assert refused.status_code == 400 and ADAPTER_WEIGHTS in refused.json()["error"]["message"]
    assert httpx.get(base_url + "/v1/audio/voices", headers=HEADERS).json()["voices"] == before
    assert not (service.adapters.storage / "broken").exists()


def test_an_adapter_voice_may_not_take_a_stored_voices_id(server):
    base_url, _, _, root = server
    taken = httpx.post(base_url + "/v1/audio/voices", headers=HEADERS, json={"id": "A", "adapter": {"path": "calm"}})
    assert taken.status_code == 409


def test_a_request_for_an_adapter_when_every_slot_serves_others_gets_429(server):
    base_url, service, _, root = server
    for name, path in (("held", "bright"), ("waiting", "spare")):
        assert httpx.post(base_url + "/v1/audio/voices", headers=HEADERS, json={"id": name, "adapter": {"path": path}}).status_code == 200
    leases = [service.adapters.acquire("calm"), service.adapters.acquire("held")]  # both slots serve requests
    try:
        body = {"model": "drama3-tiny", "input": "Hello.", "voice": "waiting", "max_new_tokens": 2}
        busy = httpx.post(base_url + "/v1/audio/speech", headers=HEADERS, json=body, timeout=60)
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "adapter_slots_busy"
        assert busy.headers["Retry-After"]
    finally:
        for lease in leases:
            lease.release()
    assert httpx.post(base_url + "/v1/audio/speech", headers=HEADERS, json=body, timeout=60).status_code == 200
    for name in ("held", "waiting"):
        httpx.delete(base_url + f"/v1/audio/voices/{name}", headers=HEADERS)


def test_a_start_flag_never_drops_an_uploaded_adapter_of_the_same_name(tmp_path, bundled_tiny):
    base, _ = bundled_tiny
    write_adapter(base, tmp_path / "src", seed=4)
    voices = tmp_path / "voices"
    first = SpeechService.load(None, str(voices), adapter_root=str(tmp_path), start_engine=False)
    first.adapters.register_upload("me", {name: (tmp_path / "src" / name).read_bytes() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)})
    stored = voices / ".adapters" / "me" / ADAPTER_WEIGHTS
    with pytest.raises(ValueError, match="an uploaded adapter 'me' is stored"):
        SpeechService.load(None, str(voices), adapter_specs=[f"me={tmp_path / 'src'}"], start_engine=False)
    assert stored.exists()
    again = SpeechService.load(None, str(voices), adapter_root=str(tmp_path), start_engine=False)
    assert again.adapters.names() == ["me"]  # uploads outlive a restart

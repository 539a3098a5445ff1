"""Fine-tuned voices under attack, on loopback (issue 58): adapter files are read only as regular
files inside `--adapter-root` once every link is resolved, at every (re)load, never waited on (a
FIFO is refused at once, `/health` and the worker pool keep serving); hostile adapter values and
damaged files get a 4xx naming what is wrong, at registration and at a later reload; adapter
voices registered by path survive a restart; damaged stored voices and adapters are skipped at
start with a log line. Each test bounds its requests and waits."""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from network_helpers import LOOPBACK, free_port, serving_on_loopback, wait_for_health
from transformers_drama3.serving.adapter_layers import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE, base_fingerprint
from transformers_drama3.training.lora import apply_lora

pytest.importorskip("uvicorn")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers_drama3.serving.app import ServerSettings, SpeechService, create_app  # noqa: E402

API_KEY = "adapter-attack-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
WAIT = 60  # seconds any one request may take on a busy 2-core machine
QUICK = 15  # seconds a refusal may take: it reads nothing that can block


def write_adapter(base, folder, seed: int, rank: int = 4):
    """A "light" adapter of drama3-tiny with non-trivial weights and its base fingerprint, in `folder`."""
    peft = apply_lora(copy.deepcopy(base), "light", r=rank)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, parameter in peft.named_parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.05)
    peft.save_pretrained(folder)
    (folder / BASE_FILE).write_text(json.dumps(base_fingerprint(base.config)))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, bundled_tiny):
    """(the adapter root holding "good" and "one" (rank 1), a folder outside it holding "far")."""
    base, _ = bundled_tiny
    root, outside = tmp_path_factory.mktemp("adapter-root"), tmp_path_factory.mktemp("outside")
    write_adapter(base, root / "good", seed=1)
    write_adapter(base, root / "one", seed=2, rank=1)
    write_adapter(base, outside / "far", seed=3)
    return root, outside


@pytest.fixture(scope="module")
def service(tmp_path_factory, folders):
    root, _ = folders
    service = SpeechService.load(None, str(tmp_path_factory.mktemp("voices")), max_batch=4, max_queue=8,
                                 adapter_specs=[f"good={root / 'good'}"], adapter_root=str(root), max_adapters=1,
                                 adapter_rank=8)
    yield service
    service.engine.stop()


@pytest.fixture(scope="module")
def server(service):
    app = create_app(lambda: service, ServerSettings(api_key=API_KEY, request_timeout=60))
    with serving_on_loopback(app) as port:
        yield f"http://{LOOPBACK}:{port}"


def assert_error(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def register(client: httpx.Client, voice_id: str, adapter: dict, timeout: float = WAIT) -> httpx.Response:
    return client.post("/v1/audio/voices", json={"id": voice_id, "adapter": adapter}, headers=HEADERS, timeout=timeout)


def speak(client: httpx.Client, voice: str) -> httpx.Response:
    body = {"input": "Hello there.", "voice": voice, "max_new_tokens": 2, "response_format": "wav"}
    return client.post("/v1/audio/speech", json=body, headers=HEADERS, timeout=WAIT)


def listed(client: httpx.Client) -> dict:
    response = client.get("/v1/audio/voices", headers=HEADERS, timeout=WAIT)
    assert response.status_code == 200, response.text
    return {voice["id"]: voice for voice in response.json()["voices"]}


def copy_adapter(source, target, fifo: str | None = None):
    """`source`'s files in `target`, the file named `fifo` (if any) replaced by a FIFO."""
    target.mkdir()
    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE):
        if file == fifo:
            os.mkfifo(target / file)
        else:
            shutil.copyfile(source / file, target / file)


def release_fifos(folder) -> None:
    """Give a reader blocked on a FIFO under `folder` its end of file (the code before the fix waits there)."""
    for path in folder.rglob("*"):
        if path.is_fifo():
            with contextlib.suppress(OSError):  # ENXIO: nobody is reading it
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def evict(client: httpx.Client) -> None:
    """Make the server's one adapter slot hold "good": any other adapter voice leaves its slot."""
    assert speak(client, "good").status_code == 200


# ---- files: regular, inside the root, never waited on --------------------------------------------------


@pytest.mark.parametrize("fifo", [ADAPTER_CONFIG, BASE_FILE])
def test_six_adapter_file_fifos_are_refused_at_once_and_the_worker_pool_keeps_serving(server, folders, fifo):
    """Six FIFOs named adapter_config.json (or drama3_base.json) held six worker threads forever."""
    root, _ = folders
    names = [f"fifo-{fifo.split('_')[1].split('.')[0]}-{index}" for index in range(6)]
    for name in names:
        copy_adapter(root / "good", root / name, fifo=fifo)
    try:
        with httpx.Client(base_url=server) as client, ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda name: register(client, name, {"path": name}, timeout=QUICK), names))
            for answer in answers:
                error = assert_error(answer, 400, "adapter", "adapter_refused")
                assert f"{fifo}: not a regular file" in error["message"]
            voices = listed(client)
            assert not set(names) & set(voices)
    finally:
        release_fifos(root)
        for name in names:
            shutil.rmtree(root / name)


@pytest.mark.parametrize("linked", [ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_FILE])
def test_an_adapter_file_that_links_outside_the_root_is_refused_without_naming_the_server_path(server, folders, linked):
    root, outside = folders
    folder = root / "linky"
    copy_adapter(root / "good", folder)
    (folder / linked).unlink()
    (folder / linked).symlink_to(outside / "far" / linked)
    try:
        with httpx.Client(base_url=server) as client:
            error = assert_error(register(client, "linky", {"path": "linky"}), 403, "adapter", "adapter_forbidden")
            assert linked in error["message"] and "outside" in error["message"]
            assert str(outside) not in error["message"] and str(root) not in error["message"]
            assert "linky" not in listed(client)
            (folder / linked).unlink()
            (folder / linked).symlink_to(root / "good" / linked)  # a link that stays inside the root is read
            assert register(client, "linky", {"path": "linky"}).status_code == 200
            assert client.delete("/v1/audio/voices/linky", headers=HEADERS, timeout=WAIT).status_code == 200
    finally:
        shutil.rmtree(folder)


def test_a_folder_swapped_for_a_link_to_outside_is_refused_at_its_next_load(server, folders, tmp_path):
    root, outside = folders
    shutil.copytree(root / "good", root / "swap")
    with httpx.Client(base_url=server) as client:
        assert register(client, "swap", {"path": "swap"}).status_code == 200
        evict(client)
        shutil.move(root / "swap", tmp_path / "swap")
        (root / "swap").symlink_to(outside / "far", target_is_directory=True)
        try:
            error = assert_error(speak(client, "swap"), 409, "voice", "voice_damaged")
            assert "swap" in error["message"] and "outside" in error["message"] and str(outside) not in error["message"]
        finally:
            (root / "swap").unlink()
            assert client.delete("/v1/audio/voices/swap", headers=HEADERS, timeout=WAIT).status_code == 200


def test_a_path_adapter_damaged_on_disk_after_leaving_its_slot_answers_409_and_the_rest_still_speak(server, folders):
    root, _ = folders
    shutil.copytree(root / "good", root / "fragile")
    try:
        with httpx.Client(base_url=server) as client:
            assert register(client, "fragile", {"path": "fragile"}).status_code == 200
            evict(client)
            weights = root / "fragile" / ADAPTER_WEIGHTS
            weights.write_bytes(weights.read_bytes()[:1000])
            for _ in range(2):  # every request: a 409 naming the voice, never a 500
                error = assert_error(speak(client, "fragile"), 409, "voice", "voice_damaged")
                assert "'fragile'" in error["message"] and ADAPTER_WEIGHTS in error["message"]
            assert speak(client, "A").status_code == 200 and speak(client, "good").status_code == 200
            assert client.delete("/v1/audio/voices/fragile", headers=HEADERS, timeout=WAIT).status_code == 200
    finally:
        shutil.rmtree(root / "fragile")


# ---- values: checked, each refusal naming its field ----------------------------------------------------


def upload(root, name: str, config: dict | None = None, config_text: str | None = None, tensors=None,
           base_text: str | None = None) -> dict:
    """The upload of adapter `name` of `root`, with its config, tensors or base file changed."""
    folder = root / name
    files = {
        ADAPTER_CONFIG: config_text if config_text is not None else json.dumps(
            {**json.loads((folder / ADAPTER_CONFIG).read_text()), **(config or {})}),
        ADAPTER_WEIGHTS: base64.b64encode(
            safetensors_torch.save(tensors) if tensors is not None else (folder / ADAPTER_WEIGHTS).read_bytes()).decode(),
    }
    if base_text is not None:
        files[BASE_FILE] = base_text
    return files


def retyped(root, name: str, dtype) -> dict:
    tensors = safetensors_torch.load_file(root / name / ADAPTER_WEIGHTS)
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].to(dtype)
    return tensors


DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE_VALUES = {
    "alpha-text": (lambda root: upload(root, "good", {"lora_alpha": "x"}), "lora_alpha='x'"),
    "alpha-nan": (lambda root: upload(root, "good", {"lora_alpha": float("nan")}), "lora_alpha=nan"),
    "alpha-infinity": (lambda root: upload(root, "good", {"lora_alpha": float("inf")}), "lora_alpha=inf"),
    "alpha-1e30": (lambda root: upload(root, "good", {"lora_alpha": 1e30}), "lora_alpha=1e+30"),
    "r-true": (lambda root: upload(root, "one", {"r": True}), "r=True; expected a positive integer"),
    "int-tensor": (lambda root: {**upload(root, "good", tensors=retyped(root, "good", torch.int32))}, "is int32"),
    "bool-tensor": (lambda root: {**upload(root, "good", tensors=retyped(root, "good", torch.bool))}, "is bool"),
    "float8-tensor": (lambda root: upload(root, "good", tensors=retyped(root, "good", torch.float8_e4m3fn)),
                      "is float8_e4m3fn"),
    "deep-config": (lambda root: upload(root, "good", config_text='{"r": 4, "deep": ' + DEEP + "}"),
                    "adapter_config.json: nested deeper than"),
    "base-list": (lambda root: upload(root, "good", base_text="[1, 2]"), "drama3_base.json holds list"),
    "deep-base": (lambda root: upload(root, "good", base_text=DEEP), "drama3_base.json: nested deeper than"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_VALUES))
def test_hostile_adapter_values_are_refused_with_a_400_naming_the_field(server, service, folders, case):
    root, _ = folders
    make, named = HOSTILE_VALUES[case]
    with httpx.Client(base_url=server) as client:
        error = assert_error(register(client, "hostile", make(root)), 400, "adapter", "adapter_refused")
        assert named in error["message"], error["message"]
        assert "hostile" not in listed(client)
    assert not (service.adapters.storage / "hostile").exists()


# ---- deletes: one wins, the rest are told there is nothing to delete ------------------------------------


def test_ten_parallel_deletes_of_one_adapter_voice_give_one_200_and_nine_404(server):
    with httpx.Client(base_url=server) as client:
        assert register(client, "doomed", {"path": "good"}).status_code == 200
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda _: client.delete("/v1/audio/voices/doomed", headers=HEADERS, timeout=WAIT),
                                    range(10)))
        assert sorted(answer.status_code for answer in answers) == [200] + [404] * 9, [a.text for a in answers]
        assert "doomed" not in listed(client)


def test_a_delete_that_loses_the_race_to_another_is_a_404(service, folders):
    """The loser of two deletes saw the adapter, then found it gone: deterministically, the route's
    second call for a voice deleted meanwhile."""
    from transformers_drama3.serving.adapter_routes import delete_adapter_voice
    from transformers_drama3.serving.protocol import ApiError

    service.adapters.register_path("raced", "good")
    assert delete_adapter_voice(service, "raced") == {"id": "raced", "deleted": True}
    with pytest.raises(ApiError) as lost:
        delete_adapter_voice(service, "raced")
    assert (lost.value.status, lost.value.param, lost.value.code) == (404, "voice", "voice_not_found")


# ---- at start: damaged voices and adapters skipped, each with a log line --------------------------------


def test_damaged_stored_voices_and_adapters_are_skipped_at_start_with_a_log_line(tmp_path, folders, caplog):
    root, _ = folders
    voices = tmp_path / "voices"
    first = SpeechService.load(None, str(voices), adapter_root=str(root), start_engine=False)
    first.adapters.register_upload("kept", {file: (root / "good" / file).read_bytes() for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)})
    first.adapters.register_upload("rotten", {file: (root / "good" / file).read_bytes() for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)})
    first.adapters.register_path("moved", "good")
    (voices / ".adapters" / "rotten" / ADAPTER_CONFIG).write_text("{not json")
    (voices / ".adapters" / ".paths" / "moved.json").write_text(json.dumps({"path": "../elsewhere"}))
    shutil.copytree(voices / "A", voices / "broken")
    (voices / "broken" / "voice.json").write_text('{"name": "bro', encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="transformers_drama3.serving"):
        again = SpeechService.load(None, str(voices), adapter_root=str(root), start_engine=False)
    assert again.adapters.names() == ["kept"]
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "rotten: adapter 'rotten' (rotten): adapter_config.json: not JSON" in logged
    assert "moved: path: '../elsewhere' lies outside" in logged
    assert "'broken'" in logged and "voice.json cannot be read" in logged
    assert (voices / ".adapters" / "rotten").is_dir()  # skipped, never removed: a later start may read it


# ---- a server process: a FIFO never freezes it; path voices survive a restart --------------------------


@contextlib.contextmanager
def serve_process(voices, root, log):
    """`drama3 serve` in a subprocess on loopback, adapters on (`--adapter-root root`); yields its URL."""
    port = free_port()
    command = [sys.executable, "-m", "transformers_drama3.cli", "serve", "--host", LOOPBACK, "--port", str(port),
               "--voices-dir", str(voices), "--adapter-root", str(root), "--max-adapters", "2", "--adapter-rank", "8",
               "--max-batch", "2", "--threads", "1"]
    with open(log, "ab") as errors:
        process = subprocess.Popen(command, env={**os.environ, "DRAMA3_API_KEY": ""}, stdout=subprocess.DEVNULL,
                                   stderr=errors)
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_for_health(url, process, timeout=240)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # frozen (the code before the fix, on a FIFO)
            process.kill()
            process.wait(timeout=30)


def test_a_fifo_named_adapter_model_safetensors_never_freezes_the_server(folders, tmp_path):
    """It was read with the interpreter's lock held: `/health` hung with it. The refusal comes at
    once, and `/health` answers throughout."""
    root, _ = folders
    copy_adapter(root / "good", root / "fifo-weights", fifo=ADAPTER_WEIGHTS)
    try:
        with serve_process(tmp_path / "voices", root, tmp_path / "server.log") as url:
            answer: dict = {}
            registering = threading.Thread(target=lambda: answer.setdefault("response", httpx.post(
                url + "/v1/audio/voices", json={"id": "fifo", "adapter": {"path": "fifo-weights"}}, timeout=QUICK)))
            registering.start()
            worst, started = 0.0, time.perf_counter()
            try:
                while registering.is_alive() or time.perf_counter() - started < 2:
                    asked = time.perf_counter()
                    assert httpx.get(url + "/health", timeout=5).status_code == 200
                    worst = max(worst, time.perf_counter() - asked)
                    time.sleep(0.1)
            finally:
                release_fifos(root)
                registering.join(timeout=QUICK)
            error = assert_error(answer["response"], 400, "adapter", "adapter_refused")
            assert f"{ADAPTER_WEIGHTS}: not a regular file" in error["message"]
            assert worst < 2.0, f"/health took {worst:.2f} s"
    finally:
        release_fifos(root)
        shutil.rmtree(root / "fifo-weights")


def test_adapter_voices_registered_by_path_survive_a_restart(folders, tmp_path):
    """Two server processes in turn on one state folder: a path adapter registered with the first
    is listed and speaks with the second; deleted there, it stays deleted."""
    root, _ = folders
    voices, log = tmp_path / "voices", tmp_path / "server.log"
    files = {ADAPTER_CONFIG: json.loads((root / "good" / ADAPTER_CONFIG).read_text()),
             ADAPTER_WEIGHTS: base64.b64encode((root / "good" / ADAPTER_WEIGHTS).read_bytes()).decode()}
    with serve_process(voices, root, log) as url:
        assert httpx.post(url + "/v1/audio/voices", json={"id": "kept", "adapter": {"path": "good"}}, timeout=WAIT).status_code == 200
        assert httpx.post(url + "/v1/audio/voices", json={"id": "sent", "adapter": files}, timeout=WAIT).status_code == 200
    with serve_process(voices, root, log) as url:
        listing = {voice["id"]: voice for voice in httpx.get(url + "/v1/audio/voices", timeout=WAIT).json()["voices"]}
        assert listing["kept"].get("adapter") is True and listing["sent"].get("adapter") is True
        body = {"input": "Hello there.", "voice": "kept", "max_new_tokens": 2, "response_format": "wav"}
        assert httpx.post(url + "/v1/audio/speech", json=body, timeout=WAIT).status_code == 200
        assert httpx.delete(url + "/v1/audio/voices/kept", timeout=WAIT).status_code == 200
    after = SpeechService.load(None, str(voices), adapter_root=str(root), start_engine=False)
    assert after.adapters.names() == ["sent"]
    assert (root / "good" / ADAPTER_WEIGHTS).is_file()  # a server path is only read, never removed

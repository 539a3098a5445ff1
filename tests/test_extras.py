"""Each extra of the project alone runs what the README says it runs: an environment per extra
(`.ci/envs.py`: torch==2.13.0 first, then the core requirements and that extra, nothing else) runs
the project's source (PYTHONPATH=src) on drama3-tiny:

- [serve]: `drama3 serve` answers /health and one speech request;
- [train]: examples/finetune_voice_lora.py trains a LoRA voice for two steps and writes its adapter;
- [demo]: `drama3 demo` serves its page and its API to gradio's own client;
- [quant]: `drama3 say --quant` with a torchao and a bitsandbytes quantiser writes a take (this found
  that [quant] alone lacked accelerate, which transformers' quantised loading needs);
- [gpu]: with flash-linear-attention and Triton importable, `drama3 say` still speaks on a CPU.

Each environment also lacks what the other extras bring (the check that it is the extra alone).
"""

import io
import json
import shutil
import subprocess
import time

import httpx
import pytest
import soundfile
from env_helpers import ROOT, bare_environment, environment
from network_helpers import LOOPBACK, free_port, wait_for_health

from transformers_drama3.tiny import shipped

pytestmark = pytest.mark.slow  # subprocesses in environments of their own
TIMEOUT = 600
OTHERS = {"serve": ("peft", "gradio"), "train": ("fastapi", "gradio"), "demo": ("peft",),
          "quant": ("fastapi", "peft"), "gpu": ("fastapi", "peft", "torchao")}
"""Packages another extra brings, which each extra's environment must not have."""


def run(python: str, *arguments: str, cwd=None) -> subprocess.CompletedProcess:
    done = subprocess.run([python, *arguments], capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd,
                          env=bare_environment(PYTHONPATH=str(ROOT / "src")))
    assert done.returncode == 0, f"{arguments} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def assert_alone(python: str, extra: str) -> None:
    probe = "import importlib.util, json, sys; print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n)]))"
    found = json.loads(run(python, "-c", probe, *OTHERS[extra]).stdout.strip().splitlines()[-1])
    assert found == [], f"the [{extra}] environment has other extras' packages: {found}"


def started(python: str, arguments: list[str], url: str, ready) -> subprocess.Popen:
    process = subprocess.Popen([python, *arguments], env=bare_environment(PYTHONPATH=str(ROOT / "src")),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ready(url, process)
    except BaseException:
        process.kill()
        raise
    return process


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=30)


def test_serve_alone_serves_a_take(tmp_path):
    python = environment("extra-serve")
    assert_alone(python, "serve")
    port = free_port()
    base = f"http://{LOOPBACK}:{port}"
    server = started(python, ["-m", "transformers_drama3.cli", "serve", "--host", LOOPBACK, "--port", str(port),
                              "--voices-dir", str(tmp_path / "voices")], base, wait_for_health)
    try:
        response = httpx.post(base + "/v1/audio/speech", timeout=TIMEOUT,
                              json={"input": "Hello there.", "voice": "B", "max_new_tokens": 20, "response_format": "wav"})
    finally:
        stop(server)
    assert response.status_code == 200, response.text
    audio, rate = soundfile.read(io.BytesIO(response.content))
    assert rate == 22050 and audio.size > 0


def test_train_alone_fine_tunes_a_voice(tmp_path):
    python = environment("extra-train")
    assert_alone(python, "train")
    voice = tmp_path / "voice"
    voice.mkdir()
    for index, name in enumerate(shipped.voices()):  # the bundled voices' clips stand in for a speaker's
        clip, transcript = shipped.reference_voice(name)
        shutil.copy(clip, voice / f"clip{index}.wav")
        (voice / f"clip{index}.txt").write_text(transcript)
    output = tmp_path / "out"
    run(python, str(ROOT / "examples" / "finetune_voice_lora.py"), "--model", shipped.TINY_MODEL_PATH, "--voice",
        str(voice), "--output", str(output), "--rank", "4", "--max-steps", "2", "--batch-size", "2", "--cpu",
        "--min-speech-fraction", "0")
    assert (output / "adapter" / "adapter_config.json").is_file()
    assert len(json.loads((output / "losses.json").read_text())) == 2


def wait_for_page(url: str, process: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            pytest.fail(f"drama3 demo exited: {process.stderr.read().decode()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"drama3 demo did not answer within {timeout:.0f} s")


def test_demo_alone_serves_its_page_and_api(tmp_path):
    python = environment("extra-demo")
    assert_alone(python, "demo")
    port = free_port()
    url = f"http://{LOOPBACK}:{port}/"
    demo = started(python, ["-m", "transformers_drama3.cli", "demo", "--host", LOOPBACK, "--port", str(port)], url,
                   wait_for_page)
    try:
        page = httpx.get(url, timeout=30).text
        api = run(python, "-c", "import sys; from gradio_client import Client; "
                  "print(len(Client(sys.argv[1], verbose=False).view_api(print_info=False, return_format='dict')"
                  "['named_endpoints']))", url)
    finally:
        stop(demo)
    assert "gradio" in page.lower()
    assert int(api.stdout.strip().splitlines()[-1]) > 0


SAY = """
import sys
{imports}
from transformers_drama3.cli import main
for output, options in zip(sys.argv[1::2], sys.argv[2::2]):
    code = main(["say", "Hello there.", "-o", output, "--max-frames", "20", "--quiet", *options.split()])
    if code:
        sys.exit(code)
"""
"""`drama3 say` once per (output, options) pair, in one process (one start of torch for all)."""


def test_quant_alone_speaks_quantised_by_torchao_and_bitsandbytes(tmp_path):
    python = environment("extra-quant")
    assert_alone(python, "quant")
    takes = {quant: tmp_path / f"{quant}.wav" for quant in ("int8", "nf4")}  # torchao's, bitsandbytes'
    run(python, "-c", SAY.format(imports=""), *(item for quant, out in takes.items() for item in (str(out), f"--quant {quant}")))
    assert all(soundfile.info(str(out)).frames > 0 for out in takes.values())


def test_gpu_alone_still_speaks_on_a_cpu(tmp_path):
    python = environment("extra-gpu")
    assert_alone(python, "gpu")
    out = tmp_path / "take.wav"
    run(python, "-c", SAY.format(imports="import fla, triton  # the kernels import; the model still runs on a CPU"),
        str(out), "")
    assert soundfile.info(str(out)).frames > 0

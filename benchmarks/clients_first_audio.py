"""Time to first audio of each client package against `drama3 serve` (drama3-tiny, loopback): the
figures of the README's clients table.

    python benchmarks/clients_first_audio.py [--runs 3]

Builds (once) the client environments of `.ci/envs.py`, starts `drama3 serve --log-requests`, warms
it with one take, then runs each client's driver (tests/client_drivers/) on one sentence with the
client's defaults, `--runs` times, one client at a time. Prints, per client, the median seconds from
the client's call to the first audio it hands on (litellm.speech returns whole takes: its time is the
whole take's) beside the server's own time to first audio for the same takes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DRIVERS = ROOT / "tests" / "client_drivers"
TEXT = "Good morning to you all, and welcome home."
TAKE = re.compile(r"drama3 serve: speech \S+ voice=\S+ .* first_audio=(?P<first>[\d.]+)s total=(?P<total>[\d.]+)s")
CLIENTS = {  # name: (environment, driver, one call with the client's defaults)
    "openai SDK (pcm, streamed)": ("clients", "openai_driver.py", {"voice": "alloy", "response_format": "pcm"}),
    "pipecat OpenAITTSService": ("clients", "pipecat_driver.py", {"voice": None}),
    "LiveKit openai.TTS synthesize (mp3 over SSE)": ("clients", "livekit_driver.py", {"mode": "synthesize"}),
    "LiveKit StreamAdapter stream": ("clients", "livekit_driver.py", {"mode": "stream"}),
    "wyoming-openai Synthesize (wav)": ("wyoming", "wyoming_driver.py", {"voice": None}),
    "litellm.speech (mp3, whole)": ("clients", "litellm_driver.py", {"voice": "alloy"}),
}


def environments() -> dict:
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "envs.py"), "clients", "wyoming"], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    pythons = environments()
    folder = Path(tempfile.mkdtemp())
    port, log = free_port(), folder / "serve.log"
    with open(log, "wb") as sink:
        server = subprocess.Popen([sys.executable, "-m", "transformers_drama3.cli", "serve", "--port", str(port),
                                   "--voices-dir", str(folder / "voices"), "--log-requests"], stdout=sink, stderr=sink)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        httpx.post(base + "/v1/audio/speech", json={"input": TEXT, "response_format": "pcm"}, timeout=300)
        print(f"time to first audio, drama3-tiny, median of {args.runs} ({os.cpu_count()} CPUs):")
        for name, (environment, driver, call) in CLIENTS.items():
            python = pythons[environment]
            if python.startswith("skip"):
                print(f"  {name}: {python}")
                continue
            firsts, servers = [], []
            for _ in range(args.runs):
                before = len(TAKE.findall(log.read_text(errors="replace")))
                request = {"base_url": base + "/v1", "port": free_port(), "calls": [{"text": TEXT, **call}]}
                done = subprocess.run([python, str(DRIVERS / driver), json.dumps(request)], capture_output=True,
                                      text=True, cwd=DRIVERS, timeout=600,
                                      env={"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"),
                                           "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
                report = json.loads(done.stdout.strip().splitlines()[-1])["calls"][0]
                firsts.append(report["first_audio"])
                servers += [float(first) for first, _ in TAKE.findall(log.read_text(errors="replace"))[before:]]
            print(f"  {name}: {statistics.median(firsts):.2f} s at the client, "
                  f"{statistics.median(servers):.2f} s at the server")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()

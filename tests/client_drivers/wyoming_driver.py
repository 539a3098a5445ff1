"""Drives `drama3 serve` through wyoming-openai, the Wyoming bridge Home Assistant uses: starts its
server process with the settings the README gives (the drama3 URL and a model name, nothing else),
then speaks to it with the Wyoming protocol's own client: `Describe` (the voices it offers) and
`Synthesize` per call, reading `AudioStart` / `AudioChunk` / `AudioStop` as Home Assistant does.

Run by tests/test_clients.py with the Python (>= 3.12) of an environment where wyoming-openai is installed:
    python wyoming_driver.py '{"base_url": ".../v1", "port": 10300, "calls": [{"voice": null, "text": "..."}]}'
Prints one JSON line: the voices `Describe` lists, the settings used, and per call the audio as a
Wyoming client plays it (samples, the rate AudioStart says), when its first chunk arrived and the call
ended (seconds from its start), and any error event.
"""

import asyncio
import json
import subprocess
import sys
import time

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeVoice

LOOPBACK = "127.0.0.1"


def settings(base_url: str, model: str) -> dict:
    """What the README tells a Home Assistant user to give wyoming-openai, as its environment."""
    return {"TTS_OPENAI_URL": base_url, "TTS_MODELS": model}


async def wait_for_bridge(port: int, bridge: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if bridge.poll() is not None:
            raise RuntimeError(f"wyoming-openai exited: {bridge.stderr.read().decode()[-2000:]}")
        try:
            _, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.2)
    raise RuntimeError(f"wyoming-openai did not listen on {port} within {timeout:.0f} s")


async def describe(port: int) -> list[str]:
    async with AsyncTcpClient(LOOPBACK, port) as client:
        await client.write_event(Describe().event())
        while True:
            event = await client.read_event()
            if event is not None and Info.is_type(event.type):
                info = Info.from_event(event)
                return [voice.name for program in info.tts for voice in program.voices]


async def synthesize(port: int, voice, text: str) -> dict:
    samples, rate, first, errors = 0, None, None, []
    started = time.perf_counter()
    async with AsyncTcpClient(LOOPBACK, port) as client:
        await client.write_event(Synthesize(text=text, voice=SynthesizeVoice(name=voice) if voice else None).event())
        while True:
            event = await asyncio.wait_for(client.read_event(), 300)
            if event is None:
                errors.append("the connection closed before AudioStop")
                break
            if AudioStart.is_type(event.type):
                rate = AudioStart.from_event(event).rate
            elif AudioChunk.is_type(event.type):
                chunk = AudioChunk.from_event(event)
                first = time.perf_counter() - started if first is None and chunk.audio else first
                samples += len(chunk.audio) // (chunk.width * chunk.channels)
            elif Error.is_type(event.type):
                errors.append(Error.from_event(event).text)
                break
            elif AudioStop.is_type(event.type):
                break
    return {"voice": voice, "samples": samples, "rate": rate, "first_audio": first,
            "seconds": time.perf_counter() - started, "errors": errors}


async def main(request: dict) -> dict:
    environment = settings(request["base_url"], request.get("model", "drama3-tiny"))
    command = [sys.executable, "-m", "wyoming_openai", "--uri", f"tcp://{LOOPBACK}:{request['port']}",
               "--log-level", "WARNING"]
    bridge = subprocess.Popen(command, env={**environment, "PATH": ""}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        await wait_for_bridge(request["port"], bridge)
        voices = await describe(request["port"])
        calls = [await synthesize(request["port"], call.get("voice"), call["text"]) for call in request["calls"]]
    finally:
        bridge.terminate()
        bridge.wait(timeout=30)
    return {"settings": environment, "voices": voices, "calls": calls}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))

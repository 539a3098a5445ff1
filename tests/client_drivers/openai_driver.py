"""Drives `drama3 serve` with the official OpenAI Python SDK: `audio.speech.with_streaming_response.create`,
reading the audio as it arrives (the SDK's documented way to play speech while it is made).

Run by tests/test_clients.py with the Python of an environment where openai is installed:
    python openai_driver.py '{"base_url": ".../v1", "calls": [{"voice": "alloy", "text": "...", "response_format": "pcm"}]}'
"response_format" is the SDK's own field (default: none sent, so mp3); "stream_format" may be "sse".
Prints one JSON line: per call, the audio (pcm: 16-bit mono at OpenAI's 24 kHz, as the SDK's
LocalAudioPlayer plays it; else decoded), when its first bytes arrived and the call ended (seconds
from its start), the response's x-request-id, and the error if one was raised.
"""

import base64
import json
import sys
import time

import openai
from decoding import decoded_samples


def speak(client: openai.OpenAI, call: dict) -> dict:
    fields = {key: call[key] for key in ("response_format", "stream_format") if call.get(key)}
    started, first, data = time.perf_counter(), None, b""
    try:
        with client.audio.speech.with_streaming_response.create(
                model=call.get("model", "tts-1"), voice=call["voice"], input=call["text"], **fields) as response:
            request_id = response.headers.get("x-request-id")
            pieces = response.iter_bytes() if call.get("stream_format") != "sse" else sse_audio(response.iter_lines())
            for piece in pieces:
                if piece and first is None:
                    first = time.perf_counter() - started
                data += piece
    except openai.OpenAIError as error:
        return {"voice": call["voice"], "errors": [f"{type(error).__name__}: {error}"]}
    ended = time.perf_counter() - started
    samples, rate = (len(data) // 2, 24000) if call.get("response_format") == "pcm" else decoded_samples(data)
    return {"voice": call["voice"], "samples": samples, "rate": rate, "first_audio": first, "seconds": ended,
            "request_ids": [request_id], "errors": []}


def sse_audio(lines):
    """The audio of OpenAI's speech events: each `speech.audio.delta`'s base64 `audio`."""
    for line in lines:
        if line.startswith("data: "):
            event = json.loads(line[6:])
            if event["type"] == "speech.audio.delta":
                yield base64.b64decode(event["audio"])


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    client = openai.OpenAI(base_url=request["base_url"], api_key="none", max_retries=0)
    print(json.dumps({"calls": [speak(client, call) for call in request["calls"]]}))

"""Drives `drama3 serve` with LiteLLM's `litellm.speech` (its "openai/" provider pointed at the
server's base URL), the way an app using LiteLLM for text-to-speech calls it.

Run by tests/test_clients.py with the Python of an environment where litellm is installed:
    python litellm_driver.py '{"base_url": ".../v1", "calls": [{"voice": "A", "text": "..."}]}'
A call may name "response_format" (default: none sent, so the server's, OpenAI's mp3). Prints one JSON
line: per call, the audio decoded from what litellm returned (samples, rate), when it returned (seconds
from the call's start: litellm.speech returns the whole take), and the error if one was raised.
"""

import json
import sys
import time

import litellm
from decoding import decoded_samples


def speak(base_url: str, call: dict) -> dict:
    options = {"response_format": call["response_format"]} if call.get("response_format") else {}
    started = time.perf_counter()
    try:
        response = litellm.speech(model=f"openai/{call.get('model', 'drama3-tiny')}", voice=call["voice"],
                                  input=call["text"], api_base=base_url, api_key="none", **options)
    except Exception as error:  # the test reports what litellm raised
        return {"voice": call["voice"], "errors": [f"{type(error).__name__}: {error}"]}
    returned = time.perf_counter() - started
    if call.get("response_format") == "pcm":  # raw 16-bit mono at OpenAI's 24 kHz, as litellm's callers play it
        samples, rate = len(response.content) // 2, 24000
    else:
        samples, rate = decoded_samples(response.content)
    return {"voice": call["voice"], "samples": samples, "rate": rate, "first_audio": returned, "seconds": returned,
            "errors": []}


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps({"calls": [speak(request["base_url"], call) for call in request["calls"]]}))

"""The server runs on the [serve] extra alone: a process in which training's packages (accelerate,
peft, datasets) and the demo's (gradio) cannot be imported serves a take, and loads the adapter code
only once it is given adapters (which it then serves without PEFT). The fresh environments of each
extra (`.ci/extras_smoke.sh`) check the same with nothing else installed; this guards it in every run.
"""

import json
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")

BLOCKED = ("accelerate", "peft", "datasets", "gradio")

SCRIPT = r"""
import json, sys, tempfile
for name in %(blocked)r:
    sys.modules[name] = None  # `import name` now raises ImportError, as where it is not installed
from starlette.testclient import TestClient
from transformers_drama3.serving.app import SpeechService, create_app

ADAPTER_MODULES = ("transformers_drama3.serving.adapter_layers", "transformers_drama3.serving.adapters",
                   "transformers_drama3.serving.adapter_routes", "transformers_drama3.training")
report = {}
for adapters in (False, True):
    folder = tempfile.mkdtemp()
    service = SpeechService.load(voices_dir=folder, max_batch=1, threads=1, adapter_root=folder if adapters else None)
    with TestClient(create_app(lambda: service), base_url="http://127.0.0.1") as client:
        response = client.post("/v1/audio/speech", json={"input": "Hello there.", "voice": "A", "seed": 0,
                                                          "max_new_tokens": 6, "response_format": "pcm"})
    service.engine.stop()
    report["adapters" if adapters else "plain"] = {
        "status": response.status_code, "bytes": len(response.content),
        "loaded": [name for name in ADAPTER_MODULES if name in sys.modules]}
print(json.dumps(report))
"""


def test_the_server_speaks_without_training_or_demo_packages_and_loads_adapter_code_only_for_adapters():
    script = SCRIPT % {"blocked": BLOCKED}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    plain, adapters = report["plain"], report["adapters"]
    assert plain["status"] == 200 and plain["bytes"] > 0
    assert plain["loaded"] == []  # no adapters given: no adapter code
    assert adapters["status"] == 200 and adapters["bytes"] > 0  # adapters on, and still no PEFT needed
    assert "transformers_drama3.serving.adapter_layers" in adapters["loaded"]
    assert "transformers_drama3.training" not in adapters["loaded"]

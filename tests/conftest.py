"""Fixtures shared by the whole test run.

The models every module needs are built once per run (session scope), not once per module:
the bundled drama3-tiny, the tiny speech bundle (model + processor with a real tokenizer and
codec) and its saved checkpoint, the random tiny model and the tiny codecs. Tests must not change
them: a test that edits weights or replaces a method builds its own (`tiny_model()`, ...).
"""

import os
import random

# The suite runs with the kernel packages bound even without CUDA (an import normally skips them
# there to save seconds): the tests prove the device router keeps such a process working on a CPU.
os.environ.setdefault("DRAMA3_KERNEL_PACKAGES", "1")

import torch  # noqa: E402  (imports no triton)

# Without CUDA the package's own Triton kernels run on CPU tensors in Triton's interpreter
# (tests/test_fused_kernels.py); it must be chosen before triton is first imported. With CUDA
# they run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from codec_helpers import tiny_codec
from generation_helpers import load_bundled_tiny, tiny_speech_bundle
from model_helpers import tiny_model
from network_helpers import free_port


@pytest.fixture(autouse=True)
def seeded_random_state():
    """Every test starts from the same random state, so a test that draws weights or inputs without
    its own generator gives the same numbers on every run and in any order (a tolerance it passes
    once, it passes always)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def bundled_tiny():
    """(model, processor) of drama3-tiny as shipped, loaded through the Auto classes."""
    from transformers_drama3.tiny import shipped

    if not shipped.is_available():
        pytest.skip("this checkout carries no drama3-tiny weights")
    return load_bundled_tiny()


@pytest.fixture(scope="session")
def speech_bundle():
    """(model, processor): `tiny_speech_bundle(seed=0)`."""
    return tiny_speech_bundle(seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, speech_bundle):
    """(folder, model, processor): the speech bundle saved as a checkpoint folder (model, tokenizer, codec/)."""
    directory = tmp_path_factory.mktemp("tiny_drama3")
    model, processor = speech_bundle
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return str(directory), model, processor


@pytest.fixture(scope="session")
def random_tiny_model():
    """`tiny_model(seed=0)`: random float32 weights, published layout, no tokenizer."""
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def codec32():
    """`tiny_codec()` in float32."""
    return tiny_codec()


@pytest.fixture(scope="session")
def codec64():
    """`tiny_codec()` in float64: equivalence tests compare to 1e-9, free of the float32 rounding
    that the random tiny codec amplifies (~1e-4 after its decoder)."""
    return tiny_codec().double()


@pytest.fixture(scope="session")
def demo_backend(tmp_path_factory):
    """The Gradio demo's backend: drama3-tiny and its bundled voices on a running engine."""
    pytest.importorskip("gradio")
    from transformers_drama3.serving.demo import load_backend

    backend = load_backend(device="cpu", max_batch=4)
    yield backend
    backend.service.engine.stop()


@pytest.fixture(scope="session")
def demo_url(demo_backend):
    """The demo page served on loopback (a free port), queued as `drama3 demo` queues it."""
    from transformers_drama3.serving.demo import build_demo

    demo = build_demo(demo_backend)
    demo.queue(default_concurrency_limit=demo_backend.concurrency, max_size=16)
    port = free_port()  # a demo the user runs may hold gradio's default port
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield url.rstrip("/")
    demo.close()

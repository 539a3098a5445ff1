"""The Hugging Face Space: the package's Gradio demo, launched as a Space runs it (`python app.py`).

The model is loaded once, here: the Space variable DRAMA3_MODEL (a Hub repo such as
fishaudio/drama-3, or a folder), else the bundled drama3-tiny. On ZeroGPU hardware the GPU work is
wrapped with `spaces.GPU`; elsewhere it runs unchanged.
"""

from transformers_drama3.serving.demo import build_demo, load_backend

backend = load_backend()
demo = build_demo(backend)
demo.queue(default_concurrency_limit=backend.concurrency, max_size=64)

if __name__ == "__main__":
    demo.launch()

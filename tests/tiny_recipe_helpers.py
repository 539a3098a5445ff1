"""A two-voice espeak corpus with its held-out split encoded, and an untrained model that matches
it (2 codebooks of 16): what the drama3-tiny probes (`text_use`, `bottleneck`) are tested on."""

from __future__ import annotations

import pytest
import torch


def held_out_setup(folder, heldout_sentences: int):
    """(dataset, model, processor, codec) for a corpus of voices A and B built in `folder`; skips
    the test without the espeak-ng program."""
    from recipes.drama3_tiny.corpus import VOICES_BY_NAME, build_corpus, espeak_available
    from recipes.drama3_tiny.lm_recipe import build_tiny_tokenizer, tiny_model_config
    from recipes.drama3_tiny.mel_codec_fit import fit_codec
    from recipes.drama3_tiny.text_use import held_out_dataset
    from transformers_drama3.modeling_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.processing_drama3 import Drama3Processor

    if not espeak_available():
        pytest.skip("espeak-ng binary not on PATH")
    build_corpus(folder / "corpus", seed=5, utterances_per_voice=2, heldout_sentences=heldout_sentences,
                 voices=[VOICES_BY_NAME["A"], VOICES_BY_NAME["B"]], progress=False)
    codec = fit_codec(folder / "corpus", num_codebooks=2, codebook_size=16, iterations=2, progress=False)
    dataset = held_out_dataset(folder / "corpus", codec, folder / "codes")
    tokenizer = build_tiny_tokenizer(dataset["text"], 16)
    torch.manual_seed(0)
    model = Drama3ForSpeechGeneration(tiny_model_config(tokenizer, 2, 16, hidden_size=64)).eval()
    return dataset, model, Drama3Processor(tokenizer, codebook_size=16, num_codebooks=2), codec

"""Shared pieces of the processor and prompting tests: one tiny tokenizer, random codes, and the
published way of building expected ids (each literal string tokenized on its own, special tokens
recognised by the tokenizer), written independently of the processor's own segment model."""

from __future__ import annotations

import functools

import torch

from transformers_drama3.processing_drama3 import Drama3Processor
from transformers_drama3.prompting.tokenizer_build import build_drama3_tokenizer

NUM_CODEBOOKS = 10


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    return build_drama3_tokenizer(vocab_size=400)


def tiny_processor(**kwargs) -> Drama3Processor:
    # The tests' references are a few frames with a word or two of transcript: placeholders, not
    # recordings, so the reference-length check is off unless a test turns it on.
    kwargs.setdefault("min_reference_fraction", 0.0)
    return Drama3Processor(tiny_tokenizer(), **kwargs)


def random_codes(frames: int, seed: int = 0, num_codebooks: int = NUM_CODEBOOKS) -> torch.Tensor:
    """Codes [num_codebooks, frames]: codebook 0 in [0, 4096), the residual ones in [0, 1024)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1024, (num_codebooks, frames), generator=generator)
    codes[0] = torch.randint(0, 4096, (frames,), generator=generator)
    return codes


def token_id(token: str) -> int:
    return tiny_tokenizer().convert_tokens_to_ids(token)


def expected_rows(segments: list, num_codebooks: int = NUM_CODEBOOKS) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [rows], audio_codes [rows, K]) of a hand-written layout.

    `segments` holds literal strings (tokenized on their own by the backend tokenizer, special
    tokens recognised, as the public implementations do) and codes tensors [K, frames]."""
    tokenizer = tiny_tokenizer()
    backend = tokenizer.backend_tokenizer
    backend.encode_special_tokens = False  # recognise special tokens, as the public code does
    semantic_start = token_id("<|semantic:0|>")
    ids: list[int] = []
    codes: list[torch.Tensor] = []
    for segment in segments:
        if isinstance(segment, str):
            piece = backend.encode(segment, add_special_tokens=False).ids
            ids += piece
            codes.append(torch.zeros(len(piece), num_codebooks, dtype=torch.long))
        else:
            ids += (segment[0] + semantic_start).tolist()
            codes.append(segment.T.long())
    return torch.tensor(ids, dtype=torch.long), torch.cat(codes)


def only_item(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and audio_codes of a one-item batch."""
    assert batch["input_ids"].shape[0] == 1
    return batch["input_ids"][0], batch["audio_codes"][0]

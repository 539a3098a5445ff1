"""The document-aware forward: a packed row gives each document what it gets when it runs alone.

Packed rows carry `document_ids` (1.. per document, 0 on padding). The tiny backbone has Gated
DeltaNet layers and a full-attention layer, the tower is on, and one acoustic codebook is fused into
the backbone input (K = 1), so every part that could leak across a document boundary is exercised.
"""

from __future__ import annotations

import pytest
import torch
from loss_oracle import document_losses, row_losses
from model_helpers import NUM_CODEBOOKS, make_rows, random_frames, tiny_model
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

import transformers_drama3  # noqa: F401  (installs the routing)
from transformers_drama3.kernels.device_dispatch import document_index
from transformers_drama3.modeling_drama3 import document_offsets, positions_in_documents
from transformers_drama3.prompting import IGNORE_INDEX

FRAMES = (4, 9, 2)  # three documents of different lengths
WIDTH = 24


def documents() -> list[dict[str, torch.Tensor]]:
    """Text prompt, audio frames, closing eos; the frames and the eos are supervised."""
    generator = torch.Generator().manual_seed(0)
    result = []
    for index, frames in enumerate(FRAMES):
        input_ids, audio_codes = make_rows([5 + index, 6, 7], random_frames(frames, generator), [2])
        labels = input_ids.clone()
        labels[:, :3] = IGNORE_INDEX
        result.append({"input_ids": input_ids[0], "audio_codes": audio_codes[0], "labels": labels[0]})
    return result


def empty_batch(count: int, width: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.zeros(count, width, dtype=torch.long),
        "audio_codes": torch.zeros(count, width, NUM_CODEBOOKS, dtype=torch.long),
        "labels": torch.full((count, width), IGNORE_INDEX),
        "attention_mask": torch.zeros(count, width, dtype=torch.long),
    }


def place(batch, row: int, start: int, document: dict) -> slice:
    span = slice(start, start + len(document["input_ids"]))
    for key in ("input_ids", "audio_codes", "labels"):
        batch[key][row, span] = document[key]
    batch["attention_mask"][row, span] = 1
    return span


def packed_batch(docs) -> tuple[dict[str, torch.Tensor], list[tuple[int, slice]]]:
    """Row 0: documents 1 and 2, then right padding; row 1: left padding, then document 3."""
    batch = empty_batch(2, WIDTH)
    batch["document_ids"] = torch.zeros(2, WIDTH, dtype=torch.long)
    first = place(batch, 0, 0, docs[0])
    second = place(batch, 0, first.stop, docs[1])
    third = place(batch, 1, WIDTH - len(docs[2]["input_ids"]), docs[2])
    spans = [(0, first), (0, second), (1, third)]
    for document, (row, span) in enumerate(spans, start=1):
        batch["document_ids"][row, span] = document
    return batch, spans


def padded_batch(docs, side: str) -> tuple[dict[str, torch.Tensor], list[slice]]:
    """One document per row, padded on `side`."""
    longest = max(len(d["input_ids"]) for d in docs)
    batch = empty_batch(len(docs), longest)
    spans = []
    for row, document in enumerate(docs):
        start = 0 if side == "right" else longest - len(document["input_ids"])
        spans.append(place(batch, row, start, document))
    return batch, spans


def model_inputs(batch) -> dict[str, torch.Tensor]:
    return {key: value for key, value in batch.items() if key != "labels"}


# ---- the kernels' per-document paths (CPU) ----------------------------------------------------------


def delta_rule_inputs(rows: int, generator: torch.Generator):
    q, k = (torch.randn(2, rows, 4, 8, generator=generator) for _ in range(2))
    v = torch.randn(2, rows, 4, 8, generator=generator)
    g = -torch.rand(2, rows, 4, generator=generator)
    beta = torch.rand(2, rows, 4, generator=generator)
    return q, k, v, g, beta


# Offsets into the flattened [2, 70] batch: row 0 holds documents of 30 and 40 rows, row 1 one of
# 5 rows, one of 65 (longer than one 64-row chunk of the reference).
OFFSETS = torch.tensor([0, 30, 70, 75, 140])


def segments(offsets):
    bounds = offsets.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def test_cpu_delta_rule_restarts_its_state_at_each_document():
    routed = qwen.torch_chunk_gated_delta_rule
    q, k, v, g, beta = delta_rule_inputs(70, torch.Generator().manual_seed(0))
    out, states = routed(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, output_final_state=True,
                         cu_seqlens=OFFSETS)
    flat = [t.reshape(1, 140, *t.shape[2:]) for t in (q, k, v, g, beta)]
    out = out.reshape(1, 140, *out.shape[2:])
    for index, (start, end) in enumerate(segments(OFFSETS)):
        alone, state = routed.drama3_reference(
            *(t[:, start:end] for t in flat[:3]), g=flat[3][:, start:end], beta=flat[4][:, start:end],
            use_qk_l2norm_in_kernel=True, output_final_state=True,
        )
        torch.testing.assert_close(out[:, start:end], alone, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(states[index : index + 1], state, rtol=1e-5, atol=1e-6)
    whole, _ = routed(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert not torch.allclose(whole.reshape(1, 140, *whole.shape[2:])[:, 30:70], out[:, 30:70], atol=1e-3)


def test_cpu_causal_conv_restarts_at_each_document():
    routed = qwen.causal_conv1d_fn
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 6, 70, generator=generator)
    weight = torch.randn(6, 4, generator=generator)
    out = routed(hidden, weight, None, activation="silu", cu_seq_lens_q=OFFSETS)
    flat, out = hidden.transpose(0, 1).reshape(1, 6, 140), out.transpose(0, 1).reshape(1, 6, 140)
    for start, end in segments(OFFSETS):
        alone = routed.drama3_reference(flat[..., start:end], weight, None, activation="silu")
        torch.testing.assert_close(out[..., start:end], alone, rtol=1e-5, atol=1e-6)
    whole = routed(hidden, weight, None, activation="silu").transpose(0, 1).reshape(1, 6, 140)
    assert not torch.allclose(whole[..., 30:33], out[..., 30:33], atol=1e-3)


def test_offsets_must_cover_the_flattened_batch():
    with pytest.raises(ValueError, match="batch \\* rows = 140"):
        document_index(torch.tensor([0, 30, 70]), 140)


def test_packed_documents_cannot_continue_from_a_state():
    q, k, v, g, beta = delta_rule_inputs(70, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="initial_state"):
        qwen.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=torch.zeros(4, 4, 8, 8),
                                          cu_seqlens=OFFSETS)


def test_positions_and_offsets_restart_per_document():
    document_ids = torch.tensor([[1, 1, 1, 2, 2, 0], [0, 0, 3, 3, 3, 3]])
    assert positions_in_documents(document_ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 0, 1, 2, 3]]
    assert document_offsets(document_ids).tolist() == [0, 3, 5, 6, 8, 12]


# ---- the model ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_packed_row_gives_each_document_its_logits_alone(attention, side):
    model = tiny_model()
    model.backbone.config._attn_implementation = attention
    docs = documents()
    packed, packed_spans = packed_batch(docs)
    alone, alone_spans = padded_batch(docs, side)
    with torch.no_grad():
        out = model(**model_inputs(packed))
        reference = model(**model_inputs(alone))
        leaky = model(**{k: v for k, v in model_inputs(packed).items() if k != "document_ids"})
    for item, ((row, span), alone_span) in enumerate(zip(packed_spans, alone_spans)):
        torch.testing.assert_close(out.logits[row, span], reference.logits[item, alone_span], rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(
            out.codebook_logits[row, span], reference.codebook_logits[item, alone_span], rtol=1e-5, atol=2e-5
        )
    row, second = packed_spans[1]
    assert not torch.allclose(leaky.logits[row, second], reference.logits[1, alone_spans[1]], atol=1e-3)


@pytest.mark.parametrize("side", ["left", "right"])
def test_packed_row_gives_each_document_its_loss_alone(side):
    model = tiny_model(text={"output_router_logits": True})
    docs = documents()
    packed, _ = packed_batch(docs)
    with torch.no_grad():
        out = model(**packed)
        per_document = document_losses(
            row_losses(model, out, packed["labels"], packed["audio_codes"]), packed["document_ids"], model.config
        )
        batch, _ = padded_batch(docs, side)
        together = model(**batch)
        for document, loss in per_document.items():
            alone, _ = padded_batch(docs[document - 1 : document], side)
            speech = model(**alone)
            without_router = speech.loss - model.config.text_config.router_aux_loss_coef * speech.aux_loss
            torch.testing.assert_close(loss, without_router, rtol=1e-5, atol=1e-5)
    assert out.aux_loss is not None
    for name in ("loss", "text_loss", "semantic_loss", "codebook_loss", "aux_loss"):
        torch.testing.assert_close(getattr(out, name), getattr(together, name), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_row_gives_the_gradients_of_the_documents_alone(checkpointing):
    docs = documents()
    packed, _ = packed_batch(docs)
    alone, _ = padded_batch(docs, "right")
    gradients = []
    for batch in (packed, alone):
        model = tiny_model().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(**batch).loss.backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys()
    assert any("linear_attn.conv1d" in name for name in gradients[0])
    for name in gradients[0]:
        torch.testing.assert_close(gradients[0][name], gradients[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_last_row_of_a_document_is_not_trained_on_the_next_one():
    model = tiny_model()
    docs = documents()
    packed, spans = packed_batch(docs)
    labelled = dict(packed, labels=packed["labels"].clone())
    row, second = spans[1]
    labelled["labels"][row, second.start] = labelled["input_ids"][row, second.start]  # a supervised first row
    with torch.no_grad():
        torch.testing.assert_close(model(**labelled).loss, model(**packed).loss)


def test_flash_attention_cannot_take_document_masks():
    model = tiny_model()
    model.backbone.config._attn_implementation = "flash_attention_2"
    packed, _ = packed_batch(documents())
    with pytest.raises(ValueError, match="unpack"):
        model(**packed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_delta_rule_restarts_at_each_document_like_the_cpu_path():
    routed = qwen.torch_chunk_gated_delta_rule
    inputs = delta_rule_inputs(70, torch.Generator().manual_seed(0))
    cpu, _ = routed(*inputs[:3], g=inputs[3], beta=inputs[4], use_qk_l2norm_in_kernel=True, cu_seqlens=OFFSETS)
    cuda_inputs = [t.cuda() for t in inputs]
    cuda, _ = routed(*cuda_inputs[:3], g=cuda_inputs[3], beta=cuda_inputs[4], use_qk_l2norm_in_kernel=True,
                     cu_seqlens=OFFSETS.cuda())
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=2e-3, atol=2e-3)

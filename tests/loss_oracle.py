"""The tests' oracle for the training objective: the model's loss recomputed per row from its logits.

`Drama3ForSpeechGeneration.forward(labels=...)` returns the paper's loss
`L_text + 0.5 L_sem + 0.5 L_cb`, each term a mean over its own bucket of rows. These helpers
compute the same terms independently, from the model's full-vocabulary logits, with a weight per
row or per document (packed rows): with every weight 1 they must give the model's loss, and the
loss of each document of a packed row must be the loss of that document alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from transformers_drama3.prompting import IGNORE_INDEX


@dataclass
class RowLosses:
    """Per-row negative log-likelihoods of one batch, each row t scored on what it predicts (row t+1).

    main: [batch, rows] NLL of the next main token (text or semantic) under the full vocabulary.
    codebook: [batch, rows] mean over the acoustic codebooks of the next frame's NLL.
    text, semantic: [batch, rows] bool, which rows belong to each bucket.
    """

    main: torch.Tensor
    codebook: torch.Tensor
    text: torch.Tensor
    semantic: torch.Tensor


def shift_left(values: torch.Tensor, fill) -> torch.Tensor:
    """Row t gets row t + 1's value; the last row gets `fill`. values: [batch, rows, ...]."""
    pad = [0, 0] * (values.dim() - 2) + [0, 1]
    return F.pad(values[:, 1:], pad, value=fill)


def row_losses(model, output, labels: torch.Tensor, audio_codes: torch.Tensor) -> RowLosses:
    """NLLs per row from `output` (a `Drama3Output` with full-vocabulary `logits`)."""
    targets = shift_left(labels, IGNORE_INDEX)  # [batch, rows]
    supervised = targets != IGNORE_INDEX
    semantic = supervised & model.is_semantic(targets)
    logits = output.logits.float()
    main = F.cross_entropy(logits.transpose(1, 2), targets.clamp(min=0), reduction="none")
    acoustic = shift_left(audio_codes, 0)[..., 1:]  # [batch, rows, num_codebooks - 1]
    codebook_logits = output.codebook_logits.float()  # [batch, rows, C - 1, size]
    codebook = F.cross_entropy(codebook_logits.permute(0, 3, 1, 2), acoustic, reduction="none").mean(-1)
    return RowLosses(main=main, codebook=codebook, text=supervised & ~semantic, semantic=semantic)


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    total = weights.sum()
    if total <= 0:
        return values.sum() * 0.0
    return (values * weights).sum() / total


def weighted_speech_loss(losses: RowLosses, config, row_weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """`L_text + w_sem L_sem + w_cb L_cb`, each a weighted mean over its bucket.

    row_weights: [batch, rows] aligned with `labels` (the weight of supervising row t), or None
    (all 1, which gives exactly the model's own loss).
    """
    if row_weights is None:
        weights = torch.ones_like(losses.main)
    else:
        weights = shift_left(row_weights.to(losses.main.dtype), 0.0)
    text = _weighted_mean(losses.main, weights * losses.text)
    semantic = _weighted_mean(losses.main, weights * losses.semantic)
    codebook = _weighted_mean(losses.codebook, weights * losses.semantic)
    loss = text + config.semantic_loss_weight * semantic + config.codebook_loss_weight * codebook
    return {"loss": loss, "text_loss": text, "semantic_loss": semantic, "codebook_loss": codebook}


def document_losses(losses: RowLosses, document_ids: torch.Tensor, config) -> dict[int, torch.Tensor]:
    """The model's loss of each document of a packed batch: {document id: loss}.

    document_ids: [batch, rows], 0 on padding, the same id on every row of one document. A row
    is scored with its own document's next row, so targets never cross a document boundary as
    long as labels are -100 on each document's last row (the collators guarantee it).
    """
    result = {}
    for document in document_ids.unique().tolist():
        if document == 0:
            continue
        inside = (document_ids == document).to(losses.main.dtype)
        result[document] = weighted_speech_loss(losses, config, inside)["loss"]
    return result

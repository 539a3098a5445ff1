"""What the serving engine takes from the decode loop of `generate()`, imported in one place.

The engine reuses the model's incremental API (`prefill`, `decode_row`, `speech_logits`,
`tower_step`) and generation's sampler, seeding, budgets and guards by name. When generation is
reorganised, this module is the only one that names where those things live.
"""

from __future__ import annotations

import torch

from ..codec.take_streaming import ClickFilter, decode_audio  # noqa: F401  (re-exported for the engine)
from ..decoding.alignment import AlignmentTracker, draw_within, resolve_alignment, turn_token_ids  # noqa: F401
from ..decoding.budget import (  # noqa: F401  (re-exported for the engine)
    BUDGET_FACTOR,
    detect_anomalies,
    expected_seconds_of_tokens,
    frame_budgets,
    overlong_factor,
    target_text_tokens,
    text_tokens_per_second,
)
from ..decoding.loop import FrameStep  # noqa: F401
from ..decoding.sampler import (  # noqa: F401  (re-exported for the engine)
    Drama3Sampler,
    SamplingSettings,
    item_generators,
    prompt_window,
    resolve_settings,
)
from ..decoding.state import Drama3Cache  # noqa: F401  (re-exported for the engine)
from ..generation_drama3 import prepare_prompt  # noqa: F401
from ..modeling_drama3 import positions_from_mask


def slot_tower_step(model, hidden, input_ids, audio_codes, semantic_code, attention_mask, tower_cache, sample):
    """`model.tower_step` for a batch whose rows end at different key columns (the slot pool).

    `model.tower_step` builds a causal mask that lets the last key column through for every row
    (it is the current row in a left-padded batch). In the pool a shorter slot's current row sits
    before the last column, so the current row attends to exactly its own real keys (the mask's
    ones, its own key included) instead; for a left-padded batch the two masks are the same.
    Shapes as in `model.tower_step`; returns codes [batch, 1, num_codebooks]."""
    positions = positions_from_mask(attention_mask, attention_mask.shape[1] - 1)
    attend = attention_mask.bool()[:, None, None, :]  # [batch, 1, 1, keys]
    is_audio = torch.ones_like(semantic_code, dtype=torch.bool)
    return model.sample_acoustic_codes(
        hidden, input_ids, audio_codes, semantic_code, is_audio, positions, attend, tower_cache, sample
    )

"""What the serving engine takes from the decode loop of `generate()`, imported in one place.

The engine runs the decode step of `generate()` (`decoding.step`) and reuses generation's sampler,
seeding, budgets and guards by name. When generation is
reorganised, this module is the only one that names where those things live.
"""

from __future__ import annotations

from ..codec.take_streaming import ClickFilter, decode_audio  # noqa: F401  (re-exported for the engine)
from ..decoding.alignment import AlignmentMasks, draw_within, resolve_alignment, turn_token_ids  # noqa: F401
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
    item_keys,
    prompt_window,
    resolve_settings,
)
from ..generation_drama3 import prepare_prompt  # noqa: F401

"""What the serving engine takes from the decode loop of `generate()`, imported in one place.

The engine reuses the model's incremental API (`prefill`, `decode_row`, `speech_logits`,
`tower_step`) and generation's sampler, seeding, budgets and guards by name. When generation is
reorganised, this module is the only one that names where those things live.
"""

from __future__ import annotations

from ..generation_drama3 import (  # noqa: F401  (re-exported for the engine)
    BUDGET_FACTOR,
    ClickFilter,
    Drama3Sampler,
    FrameStep,
    SamplingSettings,
    decode_audio,
    detect_anomalies,
    expected_seconds_of_tokens,
    frame_budgets,
    item_generators,
    prepare_prompt,
    prompt_window,
    resolve_settings,
    target_text_tokens,
)

try:  # the decode state moves from modeling to generation; either home works
    from ..generation_drama3 import Drama3Cache  # noqa: F401
except ImportError:
    from ..modeling_drama3 import Drama3Cache  # noqa: F401

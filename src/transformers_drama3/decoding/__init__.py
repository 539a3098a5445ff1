"""Decoding: the one decode step and everything it needs.

    options.py    THE option schema: every per-request option (name, type, range, default, help,
                  the doors that offer it), its one check, and the sampling settings it makes
    request.py    THE resolver: prompt rows + layout + options -> a `DecodeRequest` per item, and
                  the one constructor of a sampler from a request (`make_sampler`)
    state.py      the preallocated `DecodeCache` the prefill writes into, the fixed-shape `DecodeState`
    step.py       THE step: `draw` (main token + the tower's codes) and `feed` (the next row)
    loop.py       `DecodeRun`: a run over the step, eager or compiled, yielding `FrameStep`s
    takes.py      what a run gives back (`Drama3GenerationOutput`, `split_lines`)
    sampler.py    the sampler, the distribution it draws from, its random numbers
    budget.py     frame budgets, expected durations, anomaly guards
    alignment.py  phoneme-aligned decoding (a phonetic codec's frames follow the text)
    threads.py    how many CPU threads a decode uses

`generate()`, `stream()`, `stream_text()` and GRPO decode through `DecodeRun`; the serving engine
runs `step.step` over the items of its pool. What the package's other floors (the serving engine,
the server, the demo) use of decoding is the public surface below, imported from here.
"""

from .alignment import PhonemeAlignment, resolve_alignment  # noqa: F401
from .budget import BUDGET_FACTOR, MAX_FRAMES, detect_anomalies, overlong_factor  # noqa: F401
from .loop import (  # noqa: F401
    DecodeRun,
    FrameStep,
    LineSeparators,
    PendingStep,
    compiled_functions,
    default_compile_config,
    own_drawn_state,
    owned,
    runs_ahead,
)
from .options import (  # noqa: F401
    CLI,
    DEMO,
    GENERATE,
    HTTP,
    OPTIONS,
    STREAM,
    SCHEMA,
    Option,
    SamplingSettings,
    check_options,
    options_for,
)
from .request import (  # noqa: F401
    DecodeOptions,
    DecodeRequest,
    RequestOptions,
    line_separators,
    make_sampler,
    resolve_decoding,
    resolve_request,
    resolve_settings,
)
from .sampler import Drama3Sampler, prompt_window  # noqa: F401
from .state import DecodeCache, DecodeState  # noqa: F401
from .steady_guards import SteadyGuards  # noqa: F401
from .threads import check_threads, resolve_threads, torch_threads  # noqa: F401

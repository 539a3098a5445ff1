"""Decoding: the one decode step and everything it needs.

    state.py      the preallocated `DecodeCache` the prefill writes into, the fixed-shape `DecodeState`
    step.py       THE step: `draw` (main token + the tower's codes) and `feed` (the next row)
    loop.py       `DecodeRun`: a run over the step, eager or compiled, yielding `FrameStep`s
    request.py    a call resolved once: sampling, budgets, line separators, eager or compiled
    takes.py      what a run gives back (`Drama3GenerationOutput`, `split_lines`)
    sampler.py    sampling settings, presets, the one validator of sampling values, the sampler
    budget.py     frame budgets, expected durations, anomaly guards
    alignment.py  phoneme-aligned decoding (a phonetic codec's frames follow the text)
    threads.py    how many CPU threads a decode uses

`generate()`, `stream()`, `stream_text()` and GRPO decode through `DecodeRun`; the serving engine
runs `step.draw` / `step.feed` over the items of its pool.
"""

"""What `generate()`, `stream()` and `stream_text()` add to the model, beside `generation_drama3.py`
(the mixin, named as transformers names it): the check of transformers' generation arguments
(`arguments`), the call's resolution into decode requests (`call`), the return types (`outputs`) and
speaking text while it arrives (`live_text`). The model's floor: imports decoding/ and below."""

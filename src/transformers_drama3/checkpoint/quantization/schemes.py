"""The quantisation schemes by name, defined once and read by every place that lists them: the
command line's `--quant` choices (`runtime.command_line`), the loader (`quantized_loading`), the byte
counts (`weights`) and the memory plan (`placement.planning`).

This module imports only the standard library: the console script reads it to build `drama3`'s
flags before torch is imported.
"""

from __future__ import annotations

WEIGHT_OPTIONS = ("int8", "int4", "nf4", "bnb-int8")
"""Schemes loaded and quantised on the fly through transformers' quantisers (torchao int8 / int4,
bitsandbytes nf4 / 8-bit): `drama3 say / eval / serve --quant`, `quantization_config_for`."""

STORED_OPTIONS = ("fp8",)
"""Schemes a checkpoint stores: the published block-FP8 routed experts."""

BYTE_COUNTED = (*WEIGHT_OPTIONS, *STORED_OPTIONS)
"""The schemes whose bytes a weight `weights.quantized_bytes` counts."""

PLAN_OPTIONS = ("none", "fp8", "int8", "nf4", "int4")
"""The schemes a memory plan is made for (`drama3 plan --quant`), from the most bytes a weight
(the most faithful) to the fewest. bnb-int8 is left out: it holds int8's bytes at a slower speed."""

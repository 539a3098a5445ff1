"""Every Triton kernel of the package, compiled for the GPU it is meant for, on a machine without
one: each launch the package makes at the published shapes (`tests/triton_targets.py`), under every
autotuning config, compiled by `triton.compile` for sm_90 (H100 / H200) through ptxas, within sm_90's
shared memory, with 64-bit row offsets where a program is a prefill row. Then, in Triton's
interpreter (slow), each kernel at the published widths in bfloat16 against its reference, within
the CUDA tests' 1e-2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from script_helpers import loaded_script
from transformers_drama3.kernels import fp8_expert_gemm, fused_step, recurrent_decode, short_conv

TARGETS = Path(__file__).with_name("triton_targets.py")
SM90_SHARED_MEMORY = 227 * 1024
ROW_KERNELS = ("fused_step._partial_codebook_fusion_kernel", "fused_step._tower_injection_kernel",
               "fused_step._filtered_race_kernel")
"""The kernels of one program per row, which a prefill launches over every row of a batch (the
fusion: 1,048,576 rows of 2,048 pass 2^31 elements; the tower's injection writes 2 x 2,048 a row)."""


@pytest.fixture(scope="module")
def sm90(tmp_path_factory):
    """The compiled variants (`triton_targets.py --arch 90`), compiled in a process of their own."""
    if not fused_step.triton_available():
        pytest.skip("Triton is not installed (the [gpu] extra)")
    path = tmp_path_factory.mktemp("sm90") / "kernels.json"
    environment = {**os.environ, "TRITON_INTERPRET": "0", fused_step.TRITON_KERNELS_ENV: "1",
                   "DRAMA3_KERNEL_PACKAGES": "0"}
    done = subprocess.run([sys.executable, str(TARGETS), "--arch", "90", "--json", str(path)], env=environment,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(path.read_text())


def test_every_kernel_of_the_package_is_launched_and_compiled_under_every_config(sm90):
    defined = {f"{module}.{name}" for module, name in map(tuple, sm90["kernels"])}
    compiled = {variant["kernel"] for variant in sm90["variants"]}
    assert defined == compiled, f"kernels never launched at the published shapes: {sorted(defined - compiled)}"
    # the package's modules with Triton kernels are these four, and every `_..._kernel` they define is among them
    package = Path(fused_step.__file__).resolve().parents[1]
    with_kernels = {path.stem for path in package.rglob("*.py") if "@triton.jit" in path.read_text(encoding="utf-8")}
    assert with_kernels == {"fused_step", "fp8_expert_gemm", "recurrent_decode", "short_conv"}, with_kernels
    for module in (fused_step, fp8_expert_gemm, recurrent_decode, short_conv):
        short = module.__name__.rpartition(".")[2]
        names = {name for name in dir(module) if name.startswith("_") and name.endswith("_kernel")}
        assert names and {f"{short}.{name}" for name in names} <= defined
    failed = [f"{variant['kernel']} [{variant['variant']}; {variant['config']}]: {variant['error']}"
              for variant in sm90["variants"] if variant["error"]]
    assert not failed, "\n".join(failed)
    for launch in sm90["launches"]:
        assert launch["compiled"] == launch["configs"], launch


def test_shared_memory_is_under_the_sm90_limit(sm90):
    largest = max(sm90["variants"], key=lambda variant: variant["shared_bytes"])
    assert 0 < largest["shared_bytes"] <= SM90_SHARED_MEMORY, largest
    # the tiles of the FP8 experts' prefill use it (dot operands are staged there); so did this test
    assert largest["kernel"].startswith("fp8_expert_gemm.")


def test_row_offsets_of_the_row_kernels_are_64_bit(sm90):
    """Each pointer offset that depends on the program id (the row) is a 64-bit integer in the
    kernels' Triton IR: `row * width` in 32 bits wraps past 2^31 elements (524,288 rows of the
    tower's 2 x 2,048-wide output, 1,048,576 of the fusion's 2,048)."""
    for variant in sm90["variants"]:
        if variant["kernel"] in ROW_KERNELS:
            types = variant["row_offsets"]
            assert types, variant  # the analysis found the row's offsets
            narrow = [kind for kind in types if not re.fullmatch(r"i64|tensor<[\dx]+xi64>", kind)]
            assert not narrow, f"{variant['kernel']} [{variant['variant']}]: 32-bit row offsets {narrow}"


def test_the_offset_analysis_follows_the_program_id_through_arithmetic_and_loads():
    with loaded_script(TARGETS, "triton_targets") as targets:
        types = targets.row_offset_types(TTIR)
    assert types == ["i32", "i32", "i64"]


TTIR = """
    %0 = tt.get_program_id x : i32 loc(#loc1)
    %1 = arith.muli %0, %dim : i32 loc(#loc2)
    %2 = tt.addptr %out, %1 : !tt.ptr<bf16>, i32 loc(#loc3)
    %3 = tt.addptr %codes, %0 : !tt.ptr<i64>, i32 loc(#loc4)
    %4 = tt.load %3 : !tt.ptr<i64> loc(#loc5)
    %5 = arith.muli %4, %dim64 : i64 loc(#loc6)
    %6 = tt.addptr %table, %5 : !tt.ptr<bf16>, i64 loc(#loc7)
    %7 = tt.addptr %table, %columns : tensor<64x!tt.ptr<bf16>>, tensor<64xi32> loc(#loc8)
"""
"""A row's offset in 32 bits (%2), the row itself (%3) and a code read at the row (%6) depend on the
program id; the columns' offset (%7) does not."""


# ----------------------------------------------------------------------------- the published widths, interpreted

SLOW_TOLERANCE = 1e-2
"""The CUDA tests' tolerance: the relative error of a bfloat16 kernel's output against its reference."""


@pytest.fixture(scope="module")
def interpreter():
    if not fused_step.triton_available():
        pytest.skip("Triton is not installed (the [gpu] extra)")
    if not fused_step.interpreting():
        pytest.skip("the interpreted runs are for a machine without CUDA (tests/conftest.py sets TRITON_INTERPRET)")


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.float() - reference.float()).norm() / reference.float().norm())


def published():
    from transformers_drama3.placement.planning import published_config

    return published_config()


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.slow
def test_the_fusion_kernel_at_the_published_width_in_bfloat16(interpreter):
    config = published()
    dim, size, codebooks = config.text_config.hidden_size, config.codebook_size, config.num_codebooks
    g = generator(0)
    vocab = config.semantic_end_token_id + 1 - config.semantic_start_token_id + 64  # the rows it reads: text ids and the band
    start = vocab - size
    text = (torch.randn(vocab, dim, generator=g) * 0.02).bfloat16()
    table = (torch.randn(codebooks * size, dim, generator=g) * 0.02).bfloat16()
    ids = torch.randint(0, vocab, (4, 16), generator=g)
    codes = torch.randint(0, size, (4, 16, config.audio_decoder_config.vq_backbone_codebooks), generator=g)
    arguments = (text, table, ids, codes, start, vocab - 1, size)
    out = fused_step.partial_codebook_fusion_triton(*arguments)
    assert relative_error(out, fused_step.partial_codebook_fusion_reference(*arguments)) < SLOW_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("with_extra", [True, False], ids=["with-extra", "without-extra"])
def test_the_tower_injection_kernel_at_the_published_width_in_bfloat16(interpreter, with_extra):
    tower = published().audio_decoder_config
    dim, g = tower.dim, generator(1)
    table = (torch.randn(tower.vocab_size, dim, generator=g) * 0.02).bfloat16()
    codes = torch.randint(0, tower.vocab_size, (4, 8), generator=g)
    weight = (torch.rand(4, 8, 1, generator=g) > 0.3).bfloat16()
    extra = torch.randn(4, 8, dim, generator=g).bfloat16() if with_extra else None
    hidden = torch.randn(4, 8, dim, generator=g).bfloat16()
    norms = [(torch.randn(dim, generator=g) * 0.1).bfloat16() for _ in range(2)]
    arguments = (table, codes, weight, extra, hidden, *norms, tower.norm_eps)
    out = fused_step.tower_injection_triton(*arguments)
    assert relative_error(out, fused_step.tower_injection_reference(*arguments)) < SLOW_TOLERANCE


@pytest.mark.slow
def test_the_filtered_race_kernel_at_the_published_codebook_draws_the_references_codes(interpreter):
    """The codebook heads' draw at the published 4,096 codes, top-k 30, top-p 0.9, from bfloat16
    logits: the same codes (a draw is an argmax: bitwise, not within a tolerance)."""
    size, g = published().codebook_size, generator(2)
    logits = (torch.randn(16, size, generator=g) * 3).bfloat16()
    noise = torch.empty(16, size).exponential_(generator=g)
    drawn = fused_step.filtered_race_triton(logits, noise, 1.0, 30, 0.9, False)
    assert torch.equal(drawn, fused_step.filtered_race_reference(logits, noise, 1.0, 30, 0.9, False))


def fp8_layer(experts: int, seed: int):
    """Random block-FP8 experts at the published hidden and intermediate widths and block."""
    from transformers_drama3.checkpoint.quantization import quantize_block_fp8

    text, g = published().text_config, generator(seed)
    hidden, intermediate, block = text.hidden_size, text.moe_intermediate_size, (128, 128)

    def projection(rows, columns):
        return quantize_block_fp8(torch.randn(experts, rows, columns, generator=g) * 0.05, block)

    (gate, gate_scale), (up, up_scale) = projection(intermediate, hidden), projection(intermediate, hidden)
    down, down_scale = projection(hidden, intermediate)
    return (torch.cat((gate, up), 1), torch.cat((gate_scale, up_scale), 1), down, down_scale), block


FP8_AT_PUBLISHED_WIDTH = os.environ.get("DRAMA3_SLOW_KERNELS", "0") == "1"


@pytest.mark.slow
@pytest.mark.skipif(not FP8_AT_PUBLISHED_WIDTH, reason="4-7 minutes each in Triton's interpreter on a 2-core machine: "
                    "DRAMA3_SLOW_KERNELS=1 runs them (on a GPU, the CUDA test at the published width does)")
@pytest.mark.parametrize("layout, tokens", [("rows", 2), ("tiles", 40)])
def test_the_fp8_expert_kernels_at_the_published_width_in_bfloat16(interpreter, layout, tokens):
    """Both layouts at hidden 2,048, intermediate 512, 128 x 128 blocks, 8 experts a token (of 32
    here: the expert count is no shape of the kernels, and 32 keep the weights at 48 MiB). Each
    program loops over the published widths: thousands of interpreted tile products."""
    text, g = published().text_config, generator(3)
    weights, block = fp8_layer(32, 4)
    hidden = torch.randn(tokens, text.hidden_size, generator=g).bfloat16()
    index = torch.stack([torch.randperm(32, generator=g)[: text.num_experts_per_tok] for _ in range(tokens)])
    routing = torch.rand(tokens, text.num_experts_per_tok, generator=g) + 0.1
    function = {"rows": fp8_expert_gemm.fp8_experts_triton_rows, "tiles": fp8_expert_gemm.fp8_experts_triton_tiles}[layout]
    out = function(hidden, index, routing, *weights, block)
    reference = fp8_expert_gemm.fp8_experts_reference(hidden.float(), index, routing, *weights, block)
    assert relative_error(out, reference) < SLOW_TOLERANCE


@pytest.mark.slow
def test_the_recurrent_decode_kernel_at_the_published_heads_in_bfloat16(interpreter):
    text, g = published().text_config, generator(5)
    batch, heads, value_heads = 1, text.linear_num_key_heads, text.linear_num_value_heads
    key_dim, value_dim = text.linear_key_head_dim, text.linear_value_head_dim
    query, key = (torch.randn(batch, 1, heads, key_dim, generator=g).bfloat16() for _ in range(2))
    value = torch.randn(batch, 1, value_heads, value_dim, generator=g).bfloat16()
    decay = -torch.rand(batch, 1, value_heads, generator=g)
    beta = torch.rand(batch, 1, value_heads, generator=g).bfloat16()
    state = torch.randn(batch, value_heads, key_dim, value_dim, generator=g) * 0.1
    arguments = (query, key, value, decay, beta, state, True)
    out, new_state = recurrent_decode.gated_delta_rule_decode_triton(*arguments)
    reference, reference_state = recurrent_decode.gated_delta_rule_decode_reference(*arguments)
    assert relative_error(out, reference) < SLOW_TOLERANCE
    assert relative_error(new_state, reference_state) < SLOW_TOLERANCE


@pytest.mark.slow
def test_the_short_conv_kernel_at_the_published_channels_in_bfloat16(interpreter):
    text, g = published().text_config, generator(6)
    channels = 2 * text.linear_num_key_heads * text.linear_key_head_dim + text.linear_num_value_heads * text.linear_value_head_dim
    width = text.linear_conv_kernel_dim
    hidden = torch.randn(1, channels, 1, generator=g).bfloat16()
    state = torch.randn(1, channels, width - 1, generator=g).bfloat16()
    weight = (torch.randn(channels, width, generator=g) * 0.3).bfloat16()
    expected_state = state.clone()
    reference = short_conv.short_conv_update_reference(hidden, expected_state, weight, None, "silu")
    out = short_conv.short_conv_update_triton(hidden, state, weight, None, "silu")
    assert relative_error(out, reference) < SLOW_TOLERANCE
    assert torch.equal(state, expected_state)  # the state rolled by one column, bitwise

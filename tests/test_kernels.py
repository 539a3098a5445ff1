"""The backbone's Gated DeltaNet functions are routed by device: fla for CUDA, PyTorch otherwise."""

import importlib.util

import pytest
import torch
from model_helpers import make_rows, random_frames, tiny_model
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

import transformers_drama3  # noqa: F401  (installs the routing)
from transformers_drama3.integrations import kernel_report
from transformers_drama3.kernels.device_dispatch import ROUTED_FUNCTIONS

FLA_IMPORTS = importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None


def delta_rule_inputs(device="cpu", rows=7):
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, rows, 2, 16, generator=generator) for _ in range(2))
    v = torch.randn(2, rows, 4, 16, generator=generator)
    g = -torch.rand(2, rows, 4, generator=generator)
    beta = torch.rand(2, rows, 4, generator=generator)
    q, k = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
    return [t.to(device) for t in (q, k, v, g, beta)]


def test_every_routed_function_is_installed():
    for name in ROUTED_FUNCTIONS:
        assert hasattr(getattr(qwen, name), "drama3_reference"), name


def test_cpu_tensors_take_the_pytorch_reference():
    routed = qwen.torch_chunk_gated_delta_rule
    q, k, v, g, beta = delta_rule_inputs()
    out, state = routed(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=None)
    ref, ref_state = routed.drama3_reference(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, ref) and torch.equal(state, ref_state)


@pytest.mark.skipif(not FLA_IMPORTS, reason="flash-linear-attention / triton not installed")
def test_with_fla_installed_the_model_runs_on_cpu_and_fla_serves_cuda():
    """transformers binds fla at import; without the routing this forward fails on a CPU machine."""
    assert "fla" in kernel_report()["torch_chunk_gated_delta_rule"]
    model = tiny_model()
    input_ids, audio_codes = make_rows([5, 6, 7], random_frames(4, torch.Generator().manual_seed(0)))
    with torch.no_grad():
        logits = model(input_ids, audio_codes).logits
    assert torch.isfinite(logits).all()


@pytest.mark.gpu
@pytest.mark.skipif(not (FLA_IMPORTS and torch.cuda.is_available()), reason="needs CUDA and fla")
def test_fla_kernel_matches_the_reference_on_cuda():
    routed = qwen.torch_chunk_gated_delta_rule
    q, k, v, g, beta = delta_rule_inputs("cuda", rows=130)
    out, state = routed(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref, ref_state = routed.drama3_reference(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(state, ref_state, rtol=2e-3, atol=2e-3)

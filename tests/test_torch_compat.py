"""The torch settings that differ between the releases the GPU path runs on (CI: torch 2.13; the
device image lent to the project: torch 2.11), each chosen by the version it is given."""

import contextlib
import sys

import pytest
import torch
from transformers import CompileConfig

from transformers_drama3.kernels import torch_compat
from transformers_drama3.decoding import loop


@pytest.mark.parametrize("version, release", [
    ("2.11.0+cu130", (2, 11)), ("2.13.0+cpu", (2, 13)), ("2.13.0.dev20260501", (2, 13)), ("2.6.0", (2, 6)), ("3.0.1", (3, 0)),
])
def test_a_torch_version_reads_as_its_release(version, release):
    assert torch_compat.torch_release(version) == release


def test_a_string_that_is_no_version_is_refused_naming_it():
    with pytest.raises(ValueError, match="version: 'nightly' is not a torch version"):
        torch_compat.torch_release("nightly")


@pytest.mark.parametrize("version, counted", [
    ("2.6.0", True), ("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", False), ("2.14.0.dev20261001", False), ("3.0.0", False),
])
def test_static_address_rerecords_lift_the_limit_only_where_torch_counts_them(version, counted):
    assert torch_compat.counts_static_input_rerecords(version) is counted
    assert torch_compat.rerecord_limit_for_new_static_inputs(version, current=128) == (sys.maxsize if counted else 128)


@pytest.mark.parametrize("version, lifted", [("2.11.0+cu130", True), ("2.13.0+cpu", False)])
def test_compiling_the_step_lifts_the_rerecord_limit_on_a_torch_that_counts_static_address_churn(monkeypatch, version, lifted):
    """The step's (and the compiled prefill's) compile, on torch 2.11, lets CUDA-graph trees record
    again for every run's new cache instead of giving up after 128 runs; on 2.13 nothing changes."""
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(loop, "_COMPILED", {})
    monkeypatch.setattr(loop, "_COMPILED_PREFILL", {})
    triton = torch._inductor.config.triton
    before = triton.cudagraph_unexpected_rerecord_limit
    # inductor's own patch (pytest's monkeypatch loses the setting on torch 2.11's config proxy)
    with torch._inductor.config.patch({"triton.cudagraph_unexpected_rerecord_limit": 128}):
        loop.compiled_functions(CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None))
        assert triton.cudagraph_unexpected_rerecord_limit == (sys.maxsize if lifted else 128)
        triton.cudagraph_unexpected_rerecord_limit = 128
        loop.compiled_prefill(CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None))
        assert triton.cudagraph_unexpected_rerecord_limit == (sys.maxsize if lifted else 128)
    assert triton.cudagraph_unexpected_rerecord_limit == before


@pytest.mark.parametrize("version, name", [("2.6.0", "cache_size_limit"), ("2.7.0", "recompile_limit"), ("2.11.0+cu130", "recompile_limit")])
def test_the_recompile_limit_has_the_name_of_its_release(version, name):
    assert torch_compat.recompile_limit_name(version) == name


def test_the_installed_torch_has_the_limit_by_the_name_chosen_and_it_is_raised_never_lowered():
    # dynamo's own patch, not pytest's monkeypatch: under torch 2.11 monkeypatch reads the config
    # proxy's setting as unset and deletes it on undo, and every later compile then fails
    config = torch._dynamo.config
    name = torch_compat.recompile_limit_name()
    assert hasattr(config, name)
    before = getattr(config, name)
    with config.patch({name: 8}):
        torch_compat.raise_recompile_limit(20)
        assert getattr(config, name) == 20
        torch_compat.raise_recompile_limit(4)
        assert getattr(config, name) == 20
    assert getattr(config, name) == before


@pytest.mark.parametrize("version, overruns", [
    ("2.6.0", True), ("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", False), ("2.14.0.dev20261001", False), ("3.0.0", False),
])
def test_cpu_kernels_run_scalar_only_on_a_torch_whose_nested_reduction_stores_overrun(version, overruns):
    assert torch_compat.overruns_cpu_nested_reduction_stores(version) is overruns
    assert torch_compat.cpu_codegen_settings(version) == ({"cpp.simdlen": 1} if overruns else {})


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cpu"])
def test_the_compiled_step_and_prefill_are_compiled_with_the_cpu_codegen_settings_of_their_torch(monkeypatch, version):
    """On torch 2.11 inductor compiles the step and the prefill with scalar C++ kernels, the mode's
    own options kept (torch takes a mode or options: reduce-overhead becomes its CUDA graphs); on
    2.13 torch.compile gets the config's arguments as they are. Nothing is added to a call."""
    from torch._inductor import list_mode_options

    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(loop, "_COMPILED", {})
    monkeypatch.setattr(loop, "_COMPILED_PREFILL", {})
    monkeypatch.setattr(loop, "capturable_experts", lambda model: contextlib.nullcontext())
    given = []
    monkeypatch.setattr(torch, "compile", lambda function, **kwargs: given.append(kwargs) or function)
    config = loop.default_compile_config()
    functions = loop.compiled_functions(config)
    loop.compiled_prefill(config)
    assert functions.step is not None and len(given) == 4
    for kwargs in given:
        if version.startswith("2.11"):
            assert "mode" not in kwargs
            assert kwargs["options"] == {**list_mode_options(config.mode, kwargs["dynamic"]), "cpp.simdlen": 1}
            assert kwargs["options"]["triton.cudagraphs"] is True
        else:
            assert kwargs["mode"] == config.mode and kwargs["options"] is None
    # another backend takes no inductor options
    eager = {"backend": "eager", "mode": None, "options": None}
    assert torch_compat.with_cpu_codegen_fixes(eager) == eager
    # and torch.compile takes what the fixes give
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    for mode in (config.mode, None, "max-autotune-no-cudagraphs"):
        kwargs = torch_compat.with_cpu_codegen_fixes(loop.compile_options(CompileConfig(backend="inductor", mode=mode)))
        assert kwargs["options"] == {**(list_mode_options(mode) if mode else {}), "cpp.simdlen": 1}
        compiled = torch.compile(lambda x: x + 1, **kwargs)
        assert torch.equal(compiled(torch.arange(4.0)), torch.arange(1.0, 5.0))  # inductor takes the options

"""Each transformers internal the package relies on (transformers_drama3.integrations) is still there.

These tests fail first, and by name, when an upgrade of transformers moves one of them.
"""

import contextlib
import functools
import os
import subprocess
import sys
import warnings

import pytest
import torch
import transformers

from transformers_drama3 import integrations  # importing the package installs the routing
from transformers_drama3.integrations import InternalsChanged
from transformers_drama3.kernels.device_dispatch import ROUTED_FUNCTIONS

qwen = integrations.qwen3_5_moe  # transformers' Qwen3.5-MoE modeling module
FLA_IMPORTS = integrations.kernel_report()["torch_chunk_gated_delta_rule"].startswith("fla")


# ---- versions


def test_the_installed_transformers_is_one_the_internals_were_checked_against():
    low, high = integrations.TESTED_TRANSFORMERS
    assert integrations.transformers_is_tested(), (
        f"transformers {transformers.__version__} is outside >={low},<{high}: re-read each internal named in "
        "transformers_drama3/integrations.py against it, then move TESTED_TRANSFORMERS"
    )


def test_the_package_requires_exactly_the_transformers_releases_it_was_checked_against():
    """pip must not pick a transformers whose internals were not read: the import could fail."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    wanted = [Requirement(line) for line in requires("transformers-drama3") if Requirement(line).name == "transformers"]
    low, high = integrations.TESTED_TRANSFORMERS
    assert [(str(r.specifier), r.marker) for r in wanted] == [(str(SpecifierSet(f">={low},<{high}")), None)]


@pytest.mark.parametrize(
    "version, tested",
    [("5.24.0", True), ("5.24.3", True), ("5.24.1.dev0", True), ("5.23.9", False), ("5.25.2", True), ("5.26.0", False), ("6.0.0", False)],
)
def test_the_tested_range_includes_its_lower_end_and_excludes_its_upper_end(version, tested):
    assert integrations.transformers_is_tested(version) is tested


def test_an_untested_transformers_warns_once_on_use(monkeypatch):
    monkeypatch.setattr(integrations.transformers, "__version__", "5.99.0")
    with pytest.warns(integrations.UntestedTransformersWarning, match=r"checked against transformers >=5\.24,<5\.26; 5\.99\.0"):
        integrations.warn_if_untested()


# ---- 1. the routed functions of transformers' Qwen3.5-MoE modeling


def test_every_routed_function_is_a_qwen3_5_moe_module_function_wrapping_a_reference():
    integrations.check_routed_functions()
    for name in ROUTED_FUNCTIONS:
        routed = getattr(qwen, name)
        assert routed.drama3_reference is integrations.kernel_wrapper(routed.drama3_kernel).__wrapped__, name


def test_a_missing_routed_function_is_named_in_the_error(monkeypatch):
    monkeypatch.delattr(qwen, "causal_conv1d_update")
    with pytest.raises(InternalsChanged, match=r"modeling_qwen3_5_moe\.causal_conv1d_update: expected a module-level function"):
        integrations.check_routed_functions()


def test_the_router_refuses_to_install_over_moved_functions_and_names_the_opt_out(monkeypatch):
    monkeypatch.delattr(qwen, "causal_conv1d_update")
    with pytest.raises(InternalsChanged, match=r"causal_conv1d_update: .*Set DRAMA3_DEVICE_DISPATCH=0"):
        integrations.install_device_dispatch()


def test_a_reference_with_other_parameters_is_named_in_the_error(monkeypatch):
    def moved(q, k, v, decay, beta):
        return q

    monkeypatch.setattr(qwen, "torch_chunk_gated_delta_rule", moved)
    with pytest.raises(InternalsChanged, match=r"reference of modeling_qwen3_5_moe\.torch_chunk_gated_delta_rule"):
        integrations.check_routed_functions()


# ---- 2. the closure variable of transformers' kernel wrapper


def test_transformers_kernel_wrapper_keeps_its_kernel_in_the_closure_variable_implementation():
    for name in ROUTED_FUNCTIONS:
        wrapper = integrations.kernel_wrapper(getattr(qwen, name).drama3_kernel)
        assert "implementation" in wrapper.__code__.co_freevars, name
        implementation = integrations.kernel_implementation(wrapper)
        assert callable(implementation), name
    chunk = integrations.kernel_implementation(qwen.torch_chunk_gated_delta_rule.drama3_kernel)
    if FLA_IMPORTS:
        assert chunk.__module__.startswith("fla")
    else:
        assert chunk is qwen.torch_chunk_gated_delta_rule.drama3_reference


def test_a_kernel_wrapper_without_that_closure_variable_is_named_in_the_error():
    def reference(query):
        return query

    @functools.wraps(reference)
    def wrapper(*args, **kwargs):
        return reference(*args, **kwargs)

    with pytest.raises(InternalsChanged, match=r"kernel wrapper .*closure variable 'implementation'"):
        integrations.kernel_implementation(wrapper)


def test_a_function_module_without_the_closure_variable_func_is_named_in_the_error():
    import torch

    class Moved(torch.nn.Module):
        def forward(self, query):
            return query

    with pytest.raises(InternalsChanged, match=r"function module 'test_a_function_module.*closure variable 'func'"):
        integrations.kernel_implementation(Moved())


def test_an_unwrapped_function_is_its_own_implementation():
    def reference(query):
        return query

    assert integrations.kernel_implementation(reference) is reference


# ---- opting out of the router


def test_uninstall_puts_back_transformers_functions_and_install_routes_again():
    routed = {name: getattr(qwen, name) for name in ROUTED_FUNCTIONS}
    try:
        integrations.uninstall_device_dispatch()
        assert not integrations.device_dispatch_installed()
        for name in ROUTED_FUNCTIONS:
            assert getattr(qwen, name) is routed[name].drama3_kernel, name
        integrations.uninstall_device_dispatch()
        assert getattr(qwen, "causal_conv1d_fn") is routed["causal_conv1d_fn"].drama3_kernel
    finally:
        integrations.install_device_dispatch()
    assert integrations.device_dispatch_installed()
    for name in ROUTED_FUNCTIONS:
        assert getattr(qwen, name).drama3_kernel is routed[name].drama3_kernel, name


@pytest.mark.parametrize("value, requested", [(None, True), ("1", True), ("true", True), ("0", False), ("off", False), ("No", False)])
def test_the_environment_variable_switches_the_router_at_import(value, requested):
    environ = {} if value is None else {integrations.DEVICE_DISPATCH_ENV: value}
    assert integrations.device_dispatch_requested(environ) is requested


def test_an_unclear_environment_value_is_refused_by_name():
    with pytest.raises(ValueError, match=r"DRAMA3_DEVICE_DISPATCH='maybe': expected 1 or 0"):
        integrations.device_dispatch_requested({integrations.DEVICE_DISPATCH_ENV: "maybe"})


def test_importing_with_the_router_switched_off_leaves_transformers_functions_alone():
    check = (
        "import transformers_drama3\n"
        "from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen\n"
        "from transformers_drama3.kernels.device_dispatch import ROUTED_FUNCTIONS\n"
        "assert not any(hasattr(getattr(qwen, n), 'drama3_reference') for n in ROUTED_FUNCTIONS)\n"
    )
    environ = {**os.environ, integrations.DEVICE_DISPATCH_ENV: "0"}
    result = subprocess.run([sys.executable, "-c", check], env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


# ---- 3. fla's import: only where CUDA is, and its import-time warning


KERNEL_IMPORT_CHECK = """
import sys, torch
import transformers_drama3
from transformers_drama3.integrations import kernel_report
print("fla-imported" if "fla" in sys.modules else "fla-absent", "cuda" if torch.cuda.is_available() else "no-cuda")
print(kernel_report()["torch_chunk_gated_delta_rule"])
import fla  # still importable afterwards
"""


@pytest.mark.skipif(not FLA_IMPORTS, reason="flash-linear-attention / triton not installed")
def test_without_cuda_the_import_leaves_fla_alone_and_it_still_imports_later():
    environ = {**os.environ, integrations.KERNEL_PACKAGES_ENV: "auto"}
    result = subprocess.run([sys.executable, "-c", KERNEL_IMPORT_CHECK], env=environ, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    state, cuda = result.stdout.split()[:2]
    if cuda == "no-cuda":
        assert state == "fla-absent"
        assert result.stdout.split()[2].startswith("transformers.")
    else:
        assert result.stdout.split()[2].startswith("fla.")


@pytest.mark.parametrize("value, wanted", [("1", True), ("on", True), ("0", False), ("no", False)])
def test_the_kernel_packages_setting_is_read_as_said(value, wanted):
    assert integrations.kernel_packages_wanted({integrations.KERNEL_PACKAGES_ENV: value}) is wanted


def test_an_unclear_kernel_packages_setting_is_refused_by_name():
    with pytest.raises(ValueError, match="DRAMA3_KERNEL_PACKAGES='sometimes'"):
        integrations.kernel_packages_wanted({integrations.KERNEL_PACKAGES_ENV: "sometimes"})


def test_no_global_warning_filter_is_left_behind():
    assert not [f for f in warnings.filters if f[1] is not None and "Triton" in f[1].pattern]


# ---- 4. ProcessorMixin's private hook for a processor's parts


def test_processor_mixin_from_pretrained_still_asks_the_hook_for_the_parts(tmp_path, monkeypatch):
    from processor_helpers import tiny_processor

    from transformers_drama3.processing_drama3 import Drama3Processor

    integrations.check_processor_parts_hook()
    tiny_processor(chunk_bytes=200).save_pretrained(tmp_path)
    asked = []
    own_parts = Drama3Processor.parts_from_pretrained.__func__

    def recording(cls, path, processor_dict, **kwargs):
        asked.append(processor_dict)
        return own_parts(cls, path, processor_dict, **kwargs)

    monkeypatch.setattr(Drama3Processor, "parts_from_pretrained", classmethod(recording))
    loaded = Drama3Processor.from_pretrained(tmp_path)
    assert len(asked) == 1 and asked[0]["chunk_bytes"] == 200
    assert loaded.chunk_bytes == 200


def test_the_installed_from_pretrained_calls_one_known_parts_hook():
    hook = integrations.check_processor_parts_hook()
    assert hook == ("_resolve_subprocessors" if integrations.Version(transformers.__version__) >= integrations.Version("5.25")
                    else "_get_arguments_from_pretrained")


def test_a_moved_processor_hook_is_named_in_the_error(monkeypatch):
    hook = integrations.check_processor_parts_hook()
    monkeypatch.delattr(integrations.ProcessorMixin, hook)
    with pytest.raises(InternalsChanged, match=rf"ProcessorMixin\.{hook}: expected a classmethod"):
        integrations.check_processor_parts_hook()


def test_a_processor_hook_with_other_parameters_is_named_in_the_error(monkeypatch):
    hook = integrations.check_processor_parts_hook()
    monkeypatch.setattr(integrations.ProcessorMixin, hook, classmethod(lambda cls, path, **kw: []))
    with pytest.raises(InternalsChanged, match=rf"{hook}: expected parameters \(pretrained_model_name_or_path, processor_dict"):
        integrations.check_processor_parts_hook()


# ---- 5. cached_file's private keywords


def test_optional_file_gives_the_path_of_a_present_file_and_none_for_a_missing_one(tmp_path):
    integrations.check_optional_file_keywords()
    (tmp_path / "present.json").write_text("{}")
    assert integrations.optional_file(str(tmp_path), "present.json") == str(tmp_path / "present.json")
    assert integrations.optional_file(str(tmp_path), "codec/config.json") is None
    assert integrations.optional_file(str(tmp_path), "missing.json", local_files_only=True) is None


def test_renamed_cached_file_keywords_are_named_in_the_error(monkeypatch):
    def cached_files(path_or_repo_id, filenames, raise_for_missing_entries=True, **deprecated_kwargs):
        return None

    monkeypatch.setattr(integrations.transformers_hub, "cached_files", cached_files)
    with pytest.raises(InternalsChanged, match=r"cached_files: expected the keywords .*missing \['_raise_exceptions_for_missing_entries'"):
        integrations.optional_file(".", "config.json")


# ---- 7. the loader's checkpoint files, the Hub-upload helpers


def test_from_pretrained_tells_the_model_which_files_it_loaded(tmp_path, monkeypatch):
    from model_helpers import tiny_model

    from transformers_drama3 import Drama3ForSpeechGeneration

    integrations.check_pretrained_loader()
    tiny_model().save_pretrained(tmp_path)
    told = []
    monkeypatch.setattr(Drama3ForSpeechGeneration, "loaded_from_files", lambda self, files: told.append(files))
    Drama3ForSpeechGeneration.from_pretrained(tmp_path)
    assert told == [[str(tmp_path / "model.safetensors")]]


def test_a_moved_pretrained_loader_is_named_in_the_error(monkeypatch):
    monkeypatch.setattr(integrations.PreTrainedModel, "_load_pretrained_model", classmethod(lambda cls, *a: None))
    with pytest.raises(InternalsChanged, match=r"PreTrainedModel\._load_pretrained_model: expected a static method"):
        integrations.check_pretrained_loader()


def test_a_pretrained_loader_with_other_parameters_is_named_in_the_error(monkeypatch):
    monkeypatch.setattr(integrations.PreTrainedModel, "_load_pretrained_model", staticmethod(lambda model, files: None))
    with pytest.raises(InternalsChanged, match=r"_load_pretrained_model: expected parameters \('model', 'state_dict'"):
        integrations.check_pretrained_loader()


def test_the_hub_upload_helpers_are_there_and_a_moved_one_is_named(monkeypatch):
    integrations.check_hub_upload()
    monkeypatch.delattr(integrations.transformers_hub, "create_and_tag_model_card")
    with pytest.raises(InternalsChanged, match=r"transformers\.utils\.hub\.create_and_tag_model_card: expected a function"):
        integrations.check_hub_upload()


def test_set_attn_implementation_still_asks_the_hook_and_a_moved_one_is_named(monkeypatch):
    from transformers_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.modeling_drama3 import Drama3TextModel

    assert Drama3ForSpeechGeneration._can_set_attn_implementation() and Drama3TextModel._can_set_attn_implementation()
    monkeypatch.delattr(transformers.PreTrainedModel, "_can_set_attn_implementation")
    with pytest.raises(InternalsChanged, match=r"PreTrainedModel\._can_set_attn_implementation: expected a classmethod"):
        Drama3ForSpeechGeneration._can_set_attn_implementation()


# ---- 10. the routed experts' implementation, switched around a decode call


def experts_implementations(model) -> list[str]:
    """The implementation each of the backbone's experts modules reads at its next call."""
    return [module.config._experts_implementation for module in model.modules() if type(module) is qwen.Qwen3_5MoeExperts]


def everywhere(experts) -> bool:
    return True


def test_the_experts_run_batched_mm_inside_the_switch_and_grouped_mm_again_after_it():
    from model_helpers import tiny_model

    model = tiny_model(seed=0)
    before = experts_implementations(model)
    assert before and set(before) == {"grouped_mm"}
    asked = []
    with integrations.experts_on_batched_mm(model, where=lambda experts: asked.append(experts) or True):
        assert set(experts_implementations(model)) == {"batched_mm"}
        with integrations.experts_on_batched_mm(model, where=everywhere):  # nested: nothing left to switch
            assert set(experts_implementations(model)) == {"batched_mm"}
        assert set(experts_implementations(model)) == {"batched_mm"}  # the inner block put nothing back
    assert experts_implementations(model) == before
    assert len(asked) == 1 and asked[0] == [m for m in model.modules() if type(m) is qwen.Qwen3_5MoeExperts]
    with integrations.experts_on_batched_mm(model, where=lambda experts: False):
        assert experts_implementations(model) == before


def test_the_experts_go_back_to_grouped_mm_when_the_block_raises():
    from model_helpers import tiny_model

    model = tiny_model(seed=0)
    with pytest.raises(RuntimeError, match="the step failed"), integrations.experts_on_batched_mm(model, where=everywhere):
        assert set(experts_implementations(model)) == {"batched_mm"}
        raise RuntimeError("the step failed")
    assert set(experts_implementations(model)) == {"grouped_mm"}


def test_experts_on_another_implementation_are_left_on_it():
    from model_helpers import tiny_model

    model = tiny_model(seed=0)
    model.set_experts_implementation("eager")
    with integrations.experts_on_batched_mm(model, where=everywhere):
        assert set(experts_implementations(model)) == {"eager"}
    assert set(experts_implementations(model)) == {"eager"}  # not "restored" to grouped_mm


def test_the_switch_the_experts_rely_on_is_still_there():
    integrations.check_experts_implementation_switch()


def without_batched_mm(monkeypatch):
    monkeypatch.delitem(transformers.integrations.moe.ExpertsInterface._global_mapping, "batched_mm")


def without_the_property(monkeypatch):
    monkeypatch.delattr(transformers.PreTrainedConfig, "_experts_implementation")


def with_a_read_only_property(monkeypatch):
    monkeypatch.setattr(transformers.PreTrainedConfig, "_experts_implementation", property(lambda self: "grouped_mm"))


def with_experts_bound_once(monkeypatch):
    def forward(self, hidden_states, top_k_index, top_k_weights):  # an implementation chosen when built, say
        return self.bound_forward(hidden_states, top_k_index, top_k_weights)

    monkeypatch.setattr(qwen.Qwen3_5MoeExperts, "forward", forward)


MOVED_SWITCH = {
    "batched_mm unregistered": (without_batched_mm, r"moe\.ALL_EXPERTS_FUNCTIONS: expected the experts functions .*missing \['batched_mm'\]"),
    "no property": (without_the_property, r"PreTrainedConfig\._experts_implementation: expected a property with a setter"),
    "read-only property": (with_a_read_only_property, r"PreTrainedConfig\._experts_implementation: expected a property with a setter"),
    "forward reads no config": (with_experts_bound_once, r"Qwen3_5MoeExperts\.forward: expected use_experts_implementation's forward"),
}


@pytest.mark.parametrize("moved", MOVED_SWITCH.values(), ids=MOVED_SWITCH.keys())
def test_a_moved_experts_switch_is_named_in_the_error(monkeypatch, moved):
    move, message = moved
    move(monkeypatch)
    with pytest.raises(InternalsChanged, match=message):
        integrations.check_experts_implementation_switch()


def test_the_decode_step_refuses_to_switch_experts_over_moved_internals_and_changes_nothing(monkeypatch):
    """The guard runs where the switch is used: the first time a model's experts are switched (the
    decode loop's `capturable_experts`, around every compiled draw and feed)."""
    from model_helpers import tiny_model

    from transformers_drama3.decoding.loop import capturable_experts

    model = tiny_model(seed=0)
    without_batched_mm(monkeypatch)
    with pytest.raises(InternalsChanged, match=r"ALL_EXPERTS_FUNCTIONS"), capturable_experts(model):
        pytest.fail("the block ran over moved internals")
    assert set(experts_implementations(model)) == {"grouped_mm"}


@torch.no_grad()
def test_a_grouped_mm_model_decodes_the_same_codes_and_logits_with_its_experts_switched(monkeypatch):
    """The decode loop's switch (`capturable_experts`, float32 experts) changes how the experts
    compute, not what is drawn: a seeded run through it draws the codes the grouped-GEMM run draws,
    with the same hidden states and logits within float32 tolerance, step by step. It really runs
    transformers' batched matmuls inside (counted), and the grouped GEMM again after."""
    from generation_helpers import prompt, tiny_model

    from transformers_drama3.decoding.loop import DecodeRun, capturable_experts
    from transformers_drama3.decoding.request import RequestOptions, make_sampler, resolve_request
    from transformers_drama3.decoding.sampler import SamplingSettings

    model = tiny_model(seed=0)
    assert set(experts_implementations(model)) == {"grouped_mm"}
    batched_calls = []
    batched_mm = transformers.integrations.moe.ExpertsInterface._global_mapping["batched_mm"]
    monkeypatch.setitem(transformers.integrations.moe.ExpertsInterface._global_mapping, "batched_mm",
                        lambda *args, **kwargs: batched_calls.append(1) or batched_mm(*args, **kwargs))
    ids, codes = prompt(1)
    ids, codes, mask = ids[None], codes[None], torch.ones(1, ids.shape[0], dtype=torch.long)
    options = RequestOptions(SamplingSettings(temperature=1.5, top_k=8), max_new_tokens=8, expected_seconds=1.0)
    request = resolve_request(model, ids, mask, options)

    def decode(switch):
        run = DecodeRun.prefilled(model, ids, codes, mask, make_sampler(model, request.reseeded(3)), request.budgets)
        taken = []
        with switch:
            for step in run.steps():
                taken.append((step.main_ids, step.frames, run.state.hidden.clone(), model.speech_logits(run.state.hidden)))
        return taken

    grouped = decode(contextlib.nullcontext())
    assert batched_calls == []
    switched = decode(capturable_experts(model))
    assert batched_calls, "the switched run never ran the batched matmuls"
    assert set(experts_implementations(model)) == {"grouped_mm"}
    assert len(switched) == len(grouped) > 4
    for (main, frames, hidden, logits), (main_b, frames_b, hidden_b, logits_b) in zip(grouped, switched, strict=True):
        assert torch.equal(main, main_b) and torch.equal(frames, frames_b)
        torch.testing.assert_close(hidden_b, hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits_b, logits, rtol=1e-5, atol=1e-5)

"""Each transformers internal the package relies on (transformers_drama3.integrations) is still there.

These tests fail first, and by name, when an upgrade of transformers moves one of them.
"""

import functools
import os
import subprocess
import sys
import warnings

import pytest
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


@pytest.mark.parametrize(
    "version, tested",
    [("5.24.0", True), ("5.24.3", True), ("5.24.1.dev0", True), ("5.23.9", False), ("5.25.0", False), ("6.0.0", False)],
)
def test_the_tested_range_includes_its_lower_end_and_excludes_its_upper_end(version, tested):
    assert integrations.transformers_is_tested(version) is tested


def test_an_untested_transformers_warns_once_on_use(monkeypatch):
    monkeypatch.setattr(integrations.transformers, "__version__", "5.99.0")
    with pytest.warns(integrations.UntestedTransformersWarning, match=r"checked against transformers >=5\.24,<5\.25; 5\.99\.0"):
        integrations.warn_if_untested()


# ---- 1. the routed functions of transformers' Qwen3.5-MoE modeling


def test_every_routed_function_is_a_qwen3_5_moe_module_function_wrapping_a_reference():
    integrations.check_routed_functions()
    for name in ROUTED_FUNCTIONS:
        routed = getattr(qwen, name)
        assert routed.drama3_reference is getattr(routed.drama3_kernel, "__wrapped__"), name


def test_a_missing_routed_function_is_named_in_the_error(monkeypatch):
    monkeypatch.delattr(qwen, "causal_conv1d_update")
    with pytest.raises(InternalsChanged, match=r"modeling_qwen3_5_moe\.causal_conv1d_update: expected a module-level function"):
        integrations.check_routed_functions()


def test_a_reference_with_other_parameters_is_named_in_the_error(monkeypatch):
    def moved(q, k, v, decay, beta):
        return q

    monkeypatch.setattr(qwen, "torch_chunk_gated_delta_rule", moved)
    with pytest.raises(InternalsChanged, match=r"reference of modeling_qwen3_5_moe\.torch_chunk_gated_delta_rule"):
        integrations.check_routed_functions()


# ---- 2. the closure variable of transformers' kernel wrapper


def test_transformers_kernel_wrapper_keeps_its_kernel_in_the_closure_variable_implementation():
    for name in ROUTED_FUNCTIONS:
        wrapper = getattr(qwen, name).drama3_kernel
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


# ---- 3. fla's import-time warning


def test_no_global_warning_filter_is_left_behind():
    assert not [f for f in warnings.filters if f[1] is not None and "Triton" in f[1].pattern]

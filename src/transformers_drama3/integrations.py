"""Every place this package reaches into transformers' internals, in one file.

The rest of the package composes transformers' modules and calls its API (Auto classes,
`PreTrainedModel`, `ProcessorMixin.from_pretrained`, ...). What it replaces, overrides or reads
beyond that (module functions patched, a closure variable, a private hook, private keywords, an
unexported module) happens only here, each with a guard that raises `InternalsChanged` naming the
internal when an upgrade moves it:

1. the device router: four module-level functions of transformers' Qwen3.5-MoE modeling
   (`ROUTED_FUNCTIONS`) are replaced, process-wide, by routers from `kernels.device_dispatch`
   (opt out with `DRAMA3_DEVICE_DISPATCH=0` before the import, or `uninstall_device_dispatch()`);
   on a CUDA decode row two of them run the package's own one-op kernels (`kernels.short_conv`,
   `kernels.recurrent_decode`), which a compiled decode step holds without a graph break;
2. the closure variable `implementation` of transformers' kernel wrapper (which kernel it bound),
   and from transformers 5.25 the closure variable `func` of the kernels package's function module
   that holds that wrapper (`kernel_wrapper`);
3. flash-linear-attention's import: only where CUDA is (`DRAMA3_KERNEL_PACKAGES`), and its
   import-time warning silenced for that one import;
4. `ProcessorMixin._get_arguments_from_pretrained` (transformers 5.24) or
   `ProcessorMixin._resolve_subprocessors` (5.25), the private hook through which
   `ProcessorMixin.from_pretrained` loads a processor's parts (`ProcessorMixinWithOwnParts`);
5. the private keywords of `transformers.utils.cached_file` that make a missing file give None
   (`optional_file`);
6. `transformers.conversion_mapping` (not exported by transformers): the published per-expert
   tensor names <-> the fused experts of the backbone (`use_per_expert_checkpoint_names`);
7. `PreTrainedModel._load_pretrained_model`, the private static method through which
   `from_pretrained` reads the resolved checkpoint files (`PreTrainedModelWithLoadedFiles` tells
   the model which files it was loaded from), and the Hub-upload helpers `save_pretrained(...,
   push_to_hub=True)` uses (`PushToHubMixin._get_files_timestamps` / `_upload_modified_files`,
   `transformers.utils.hub.hf_api` / `create_and_tag_model_card`; `start_hub_upload`);
8. `PreTrainedModel._can_set_experts_implementation`, the private classmethod through which
   transformers decides whether a model may take an `experts_implementation`
   (`PreTrainedModelWithComposedExperts`);
9. `PreTrainedModel._can_set_attn_implementation`, the private classmethod through which
   `set_attn_implementation` decides whether a model may switch its attention implementation after
   loading (`PreTrainedModelWithComposedAttention`);
10. `PreTrainedConfig._experts_implementation`, the private attribute of a config that
    transformers' experts (`@use_experts_implementation`) read at every call to pick their
    forward: set and put back around a call, so that a compiled decode step runs the routed experts
    on batched matmuls (`experts_on_batched_mm`).

The guards run where the internal is used, and `tests/test_integrations.py` runs each of them, so an
upgrade that moves one fails there first, with the internal's name in the message. The internals
were checked against the transformers versions in `TESTED_TRANSFORMERS`; an import outside them
warns once (`UntestedTransformersWarning`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable

import transformers
from packaging.version import Version
from transformers import PreTrainedConfig, PreTrainedModel, conversion_mapping
from transformers.integrations import moe as transformers_moe
from transformers.processing_utils import ProcessorMixin
from transformers.utils import cached_file
from transformers.utils import hub as transformers_hub

from .kernels.device_dispatch import ROUTED_FUNCTIONS, router_for

# [lowest, first untested): the transformers releases whose internals the guards below were read against.
TESTED_TRANSFORMERS = ("5.24", "5.26")

DEVICE_DISPATCH_ENV = "DRAMA3_DEVICE_DISPATCH"


class InternalsChanged(RuntimeError):
    """A transformers internal this package relies on is not where (or what) it was."""


class UntestedTransformersWarning(UserWarning):
    """The installed transformers is outside `TESTED_TRANSFORMERS`."""


def _changed(what: str, expected: str) -> InternalsChanged:
    low, high = TESTED_TRANSFORMERS
    return InternalsChanged(
        f"{what}: expected {expected} (as in transformers >={low},<{high}); transformers "
        f"{transformers.__version__} is installed. transformers_drama3.integrations needs updating."
    )


def transformers_is_tested(version: str | None = None) -> bool:
    """Whether `version` (default: the installed transformers) lies in `TESTED_TRANSFORMERS`."""
    low, high = TESTED_TRANSFORMERS
    version = transformers.__version__ if version is None else version
    return Version(low) <= Version(Version(version).base_version) < Version(high)


def warn_if_untested() -> None:
    """One warning when the installed transformers is outside `TESTED_TRANSFORMERS`."""
    if not transformers_is_tested():
        low, high = TESTED_TRANSFORMERS
        warnings.warn(
            f"transformers_drama3 was checked against transformers >={low},<{high}; "
            f"{transformers.__version__} is installed. The internals it relies on are guarded "
            f"(transformers_drama3.integrations), but run tests/test_integrations.py to be sure.",
            UntestedTransformersWarning,
            stacklevel=2,
        )


# ----------------------------------------------------------------------------- 1-3. device router


KERNEL_PACKAGES_ENV = "DRAMA3_KERNEL_PACKAGES"
# The packages transformers' Qwen3.5-MoE module binds its Gated DeltaNet functions to at import.
KERNEL_PACKAGES = ("fla", "causal_conv1d")


def kernel_packages_wanted(environ=os.environ) -> bool:
    """Whether transformers may bind the kernel packages when its Qwen3.5-MoE module is imported.

    DRAMA3_KERNEL_PACKAGES: "auto" (default) binds them only when CUDA is available, because they
    serve CUDA tensors alone and importing flash-linear-attention costs several seconds; "1" always
    (tests of the router on a CPU machine); "0" never."""
    value = environ.get(KERNEL_PACKAGES_ENV, "auto").strip().lower()
    if value in ("auto", ""):
        import torch

        return torch.cuda.is_available()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{KERNEL_PACKAGES_ENV}={environ[KERNEL_PACKAGES_ENV]!r}: expected auto, 1 or 0")


@contextlib.contextmanager
def _kernel_packages_hidden():
    """Make `import fla` / `import causal_conv1d` fail inside the block (a None entry in
    sys.modules), so transformers binds its PyTorch functions; the packages import normally after."""
    hidden = [name for name in KERNEL_PACKAGES if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]


def _import_qwen3_5_moe_modeling():
    """transformers' Qwen3.5-MoE modeling module. Importing it imports flash-linear-attention when
    installed and wanted (`kernel_packages_wanted`), which warns that Triton has no GPU on a CPU
    machine: harmless here, because the routers never hand fla a CPU tensor, so that one warning
    from that one import is dropped."""
    hide = contextlib.nullcontext() if kernel_packages_wanted() else _kernel_packages_hidden()
    with warnings.catch_warnings(), hide:
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform", module=r"fla\.")
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    return modeling_qwen3_5_moe


qwen3_5_moe = _import_qwen3_5_moe_modeling()


def kernel_wrapper(exposed):
    """transformers' kernel wrapper behind `exposed`, a routed function as its modeling module holds it.

    Up to transformers 5.24 the module holds the wrapper itself. From 5.25 (which requires the
    kernels package) it holds an instance of a kernels function module (a `torch.nn.Module`) whose
    `forward` calls the wrapper; kernels keeps it only in that method's closure variable `func`."""
    import torch

    if not isinstance(exposed, torch.nn.Module):
        return exposed
    return _closure_variable(
        type(exposed).forward, "func", f"the function module {type(exposed).__qualname__!r} transformers exposes",
        "a forward with a closure variable 'func' (the function it calls)",
    )


def _closure_variable(function, name: str, what: str, expected: str):
    """The closure variable `name` of `function`, or `InternalsChanged` naming `what` and `expected`."""
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_freevars:
        raise _changed(what, expected)
    return inspect.getclosurevars(function).nonlocals[name]


def kernel_implementation(kernel):
    """The function transformers' kernel wrapper `kernel` (or the function module that holds it,
    see `kernel_wrapper`) calls: a package kernel (fla's) or the PyTorch reference itself.

    transformers (`integrations.hub_kernels.use_kernel_func_from_hub_with_fallback`) keeps that
    choice only in the wrapper's closure variable `implementation`; there is no public accessor.
    A function transformers did not wrap (no `__wrapped__`) is its own implementation."""
    kernel = kernel_wrapper(kernel)
    if not hasattr(kernel, "__wrapped__"):
        return kernel
    return _closure_variable(
        kernel, "implementation", f"transformers' kernel wrapper {getattr(kernel, '__qualname__', kernel)!r}",
        "a closure variable 'implementation' (the kernel it calls)",
    )


def check_routed_functions() -> None:
    """Each routed function is still a module global of transformers' Qwen3.5-MoE modeling that
    wraps a PyTorch reference taking (query, key, value, g, beta) or (hidden_states, weight, ...)."""
    expected_first = {
        "torch_chunk_gated_delta_rule": ("query", "key", "value", "g", "beta"),
        "torch_recurrent_gated_delta_rule": ("query", "key", "value", "g", "beta"),
        "causal_conv1d_fn": ("hidden_states", "weight"),
        "causal_conv1d_update": ("hidden_states", "conv_state", "weight"),
    }
    for name in ROUTED_FUNCTIONS:
        current = getattr(qwen3_5_moe, name, None)
        if not callable(current):
            raise _changed(f"transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.{name}", "a module-level function")
        reference = inspect.unwrap(kernel_wrapper(_original(current)))
        first = tuple(inspect.signature(reference).parameters)[: len(expected_first[name])]
        if first != expected_first[name]:
            raise _changed(
                f"the PyTorch reference of modeling_qwen3_5_moe.{name}",
                f"leading parameters {expected_first[name]}, got {first}",
            )
        kernel_implementation(_original(current))


def _original(function):
    """transformers' own function behind a router (the function itself when none is installed)."""
    return getattr(function, "drama3_kernel", function)


def device_dispatch_installed() -> bool:
    """Whether every routed function of the backbone is a device router now."""
    return all(hasattr(getattr(qwen3_5_moe, name), "drama3_reference") for name in ROUTED_FUNCTIONS)


def install_device_dispatch() -> None:
    """Replace each routed function of transformers' Qwen3.5-MoE modeling by its device router
    (idempotent). The replacement is process-wide: every Qwen3.5-MoE model in the process uses it.
    For CUDA tensors without packed documents a router calls exactly what transformers bound; for
    other tensors it calls the PyTorch reference, where transformers would call fla and fail."""
    try:
        check_routed_functions()
    except InternalsChanged as error:
        raise InternalsChanged(f"{error} Set {DEVICE_DISPATCH_ENV}=0 to import without the device router.") from None
    for name in ROUTED_FUNCTIONS:
        current = getattr(qwen3_5_moe, name)
        if hasattr(current, "drama3_reference"):
            continue
        wrapper = kernel_wrapper(current)
        setattr(qwen3_5_moe, name, router_for(name, current, inspect.unwrap(wrapper), kernel_implementation(wrapper)))


def uninstall_device_dispatch() -> None:
    """Put transformers' own functions back (idempotent); `install_device_dispatch` routes again."""
    for name in ROUTED_FUNCTIONS:
        setattr(qwen3_5_moe, name, _original(getattr(qwen3_5_moe, name)))


def device_dispatch_requested(environ=os.environ) -> bool:
    """Whether `import transformers_drama3` installs the router: yes unless DRAMA3_DEVICE_DISPATCH
    is 0 / false / no / off."""
    value = environ.get(DEVICE_DISPATCH_ENV, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{DEVICE_DISPATCH_ENV}={environ[DEVICE_DISPATCH_ENV]!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def kernel_report() -> dict[str, str]:
    """Which implementation each routed function uses for CUDA tensors (the CPU always uses PyTorch
    while the router is installed): transformers' choice, preceded, where the router runs the
    package's own kernel on a CUDA decode row (Triton installed), by that kernel's op."""
    report = {}
    for name in ROUTED_FUNCTIONS:
        current = getattr(qwen3_5_moe, name)
        implementation = kernel_implementation(_original(current))
        bound = f"{getattr(implementation, '__module__', '?')}.{getattr(implementation, '__name__', '?')}"
        decode_op = _decode_op(current)
        report[name] = bound if decode_op is None else f"{decode_op} on a decode row, else {bound}"
    return report


def _decode_op(routed) -> str | None:
    """`torch.ops.drama3.<name>`, the op a router runs on a CUDA decode row, when it can run one."""
    kernel = getattr(routed, "drama3_decode_kernel", None)
    module = sys.modules.get(getattr(kernel, "__module__", ""), None)
    if kernel is None or not module.triton_available():
        return None
    return f"torch.ops.drama3.{kernel.__name__}"


# ----------------------------------------------------------------------------- 4. ProcessorMixin


# The classmethods through which `ProcessorMixin.from_pretrained` loads a processor's parts, each
# taking (pretrained_model_name_or_path, processor_dict, **kwargs): transformers 5.24 asks
# `_get_arguments_from_pretrained` for them (a list, in `__init__`'s order); 5.25 has
# `_resolve_subprocessors` put them into the processor dict (returning it and the kwargs left).
PROCESSOR_PARTS_HOOKS = ("_get_arguments_from_pretrained", "_resolve_subprocessors")


def check_processor_parts_hook() -> str:
    """The name of the hook (`PROCESSOR_PARTS_HOOKS`) the installed `ProcessorMixin.from_pretrained`
    calls, checked to be a classmethod taking (pretrained_model_name_or_path, processor_dict, **kwargs)."""
    called = ProcessorMixin.from_pretrained.__func__.__code__.co_names
    names = [name for name in PROCESSOR_PARTS_HOOKS if name in called]
    if len(names) != 1:
        raise _changed("ProcessorMixin.from_pretrained", f"a call of exactly one of {PROCESSOR_PARTS_HOOKS}, got {names}")
    hook = getattr(ProcessorMixin, names[0], None)
    if hook is None:
        raise _changed(f"ProcessorMixin.{names[0]}", "a classmethod that loads the parts")
    parameters = tuple(inspect.signature(hook).parameters)
    if parameters[:2] != ("pretrained_model_name_or_path", "processor_dict"):
        raise _changed(
            f"ProcessorMixin.{names[0]}",
            f"parameters (pretrained_model_name_or_path, processor_dict, **kwargs), got {parameters}",
        )
    return names[0]


class ProcessorMixinWithOwnParts(ProcessorMixin):
    """A `ProcessorMixin` that loads its own parts (tokenizer, feature extractor, ...) in
    `from_pretrained`, through the public classmethod `parts_from_pretrained` of the subclass.

    transformers' default loads every feature extractor through `AutoFeatureExtractor`, which fails
    for a folder without `preprocessor_config.json` (the published Drama 3 repo). The only way to
    change that is to override the private hook `from_pretrained` calls for the parts
    (`PROCESSOR_PARTS_HOOKS`: one per transformers release), done here for both and checked by
    `check_processor_parts_hook` on every load."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        check_processor_parts_hook()
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        return cls.parts_from_pretrained(pretrained_model_name_or_path, processor_dict or {}, **kwargs)

    @classmethod
    def _resolve_subprocessors(cls, pretrained_model_name_or_path, processor_dict, **kwargs):
        """transformers 5.25's hook: the parts go into the processor dict under the names of
        `__init__`'s first parameters; the keywords that only said where to load from are spent."""
        parts = cls.parts_from_pretrained(pretrained_model_name_or_path, processor_dict or {}, **kwargs)
        names = [name for name in inspect.signature(cls.__init__).parameters if name != "self"][: len(parts)]
        for key in (*HUB_KEYWORDS, "subfolder", "return_unused_kwargs"):
            kwargs.pop(key, None)
        return {**(processor_dict or {}), **dict(zip(names, parts))}, kwargs

    @classmethod
    def parts_from_pretrained(cls, pretrained_model_name_or_path, processor_dict: dict, **kwargs) -> list:
        """The positional arguments of `__init__` (its parts), in order. `processor_dict` is the
        saved processor_config.json ({} when there is none); kwargs are the hub keywords
        (cache_dir, revision, token, ...) and `subfolder`."""
        raise NotImplementedError(f"{cls.__name__} must implement parts_from_pretrained")


# ----------------------------------------------------------------------------- 5. cached_file

# The keywords of `from_pretrained` that say where and how to fetch a file from the Hub.
HUB_KEYWORDS = ("cache_dir", "force_download", "token", "revision", "local_files_only")

_MISSING_FILE_KEYWORDS = ("_raise_exceptions_for_missing_entries", "_raise_exceptions_for_connection_errors")


def hub_keywords(kwargs: dict) -> dict:
    """The `HUB_KEYWORDS` among `kwargs`."""
    return {key: kwargs[key] for key in HUB_KEYWORDS if key in kwargs}


def check_optional_file_keywords() -> None:
    """`cached_file` still forwards to `cached_files`, which still names the two private keywords
    (it also takes **deprecated_kwargs, so a renamed keyword would be swallowed silently)."""
    if "cached_files" not in cached_file.__code__.co_names:
        raise _changed("transformers.utils.cached_file", "a call of transformers.utils.hub.cached_files")
    parameters = inspect.signature(transformers_hub.cached_files).parameters
    missing = [name for name in _MISSING_FILE_KEYWORDS if name not in parameters]
    if missing:
        raise _changed("transformers.utils.hub.cached_files", f"the keywords {_MISSING_FILE_KEYWORDS}, missing {missing}")


def optional_file(path_or_repo_id, filename: str, **hub) -> str | None:
    """The local path of `filename` in a folder or Hub repo (downloaded and cached), or None when
    it has no such file or the Hub cannot be reached. hub: `HUB_KEYWORDS`."""
    check_optional_file_keywords()
    return cached_file(path_or_repo_id, filename, **dict.fromkeys(_MISSING_FILE_KEYWORDS, False), **hub)


# ----------------------------------------------------------------------------- 6. conversion mapping

# The transformers MoE whose conversion stores routed experts one by one, as the published checkpoint does.
PER_EXPERT_MODEL_TYPE = "qwen2_moe"


def check_conversion_mapping() -> None:
    """transformers still keeps per-model-type weight conversions, one of them for `PER_EXPERT_MODEL_TYPE`."""
    for name in ("get_checkpoint_conversion_mapping", "register_checkpoint_conversion_mapping"):
        if not callable(getattr(conversion_mapping, name, None)):
            raise _changed(f"transformers.conversion_mapping.{name}", "a function")
    if not conversion_mapping.get_checkpoint_conversion_mapping(PER_EXPERT_MODEL_TYPE):
        raise _changed(
            f"transformers.conversion_mapping.get_checkpoint_conversion_mapping({PER_EXPERT_MODEL_TYPE!r})",
            "the per-expert <-> fused experts conversion",
        )


def use_per_expert_checkpoint_names(model_type: str) -> None:
    """Load and save models of `model_type` with routed experts stored one by one.

    The published checkpoint stores routed experts one by one (`mlp.experts.E.gate_proj.weight`),
    transformers' Qwen3.5-MoE fuses them (`mlp.experts.gate_up_proj`). transformers already knows
    that conversion for its MoE models; registering it for `model_type` applies it on load and,
    reversed, on save, so saved files keep the published names."""
    check_conversion_mapping()
    conversion_mapping.register_checkpoint_conversion_mapping(
        model_type, conversion_mapping.get_checkpoint_conversion_mapping(PER_EXPERT_MODEL_TYPE), overwrite=True
    )


# ----------------------------------------------------------------------------- 7. loaded files, Hub uploads

_LOADER_PARAMETERS = ("model", "state_dict", "checkpoint_files", "load_config")


def check_pretrained_loader() -> None:
    """`PreTrainedModel.from_pretrained` still reads the weights through the static method
    `_load_pretrained_model(model, state_dict, checkpoint_files, load_config, ...)`."""
    loader = inspect.getattr_static(PreTrainedModel, "_load_pretrained_model", None)
    if not isinstance(loader, staticmethod):
        raise _changed("PreTrainedModel._load_pretrained_model", "a static method that loads the checkpoint files")
    parameters = tuple(inspect.signature(loader.__func__).parameters)
    if parameters[: len(_LOADER_PARAMETERS)] != _LOADER_PARAMETERS:
        raise _changed("PreTrainedModel._load_pretrained_model", f"parameters {_LOADER_PARAMETERS}, got {parameters}")
    if "_load_pretrained_model" not in PreTrainedModel.from_pretrained.__func__.__code__.co_names:
        raise _changed("PreTrainedModel.from_pretrained", "a call of cls._load_pretrained_model")


class PreTrainedModelWithLoadedFiles(PreTrainedModel):
    """A `PreTrainedModel` told which files `from_pretrained` loaded its weights from: once they are
    loaded, `from_pretrained` calls the public method `loaded_from_files(files)` of the subclass.

    Only transformers' private loader `_load_pretrained_model` sees the resolved files (a local
    folder, or the Hub cache, shards included); it is overridden here and checked by
    `check_pretrained_loader` on every load."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        check_pretrained_loader()
        return super().from_pretrained(*args, **kwargs)

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        loaded = PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        if isinstance(model, PreTrainedModelWithLoadedFiles) and checkpoint_files:
            model.loaded_from_files([os.fspath(file) for file in checkpoint_files])
        return loaded

    def loaded_from_files(self, files: list[str]) -> None:
        """Called by `from_pretrained` once the weights in `files` are loaded; does nothing here."""


_UPLOAD_HELPERS = ("_get_files_timestamps", "_upload_modified_files")


def check_hub_upload() -> None:
    """The helpers transformers' own `save_pretrained(..., push_to_hub=True)` uses are still there."""
    for name in _UPLOAD_HELPERS:
        if not callable(getattr(PreTrainedModel, name, None)):
            raise _changed(f"PushToHubMixin.{name}", "a method")
    for name in ("hf_api", "create_and_tag_model_card"):
        if not callable(getattr(transformers_hub, name, None)):
            raise _changed(f"transformers.utils.hub.{name}", "a function")


def start_hub_upload(model, directory, token, hub_kwargs: dict):
    """`save_pretrained(directory, push_to_hub=True, **hub_kwargs)` as transformers does it: create
    the repo now (`repo_id` defaults to the folder's name), note the folder's files, and return the
    call that, after the save, uploads the files it changed, with a model card."""
    check_hub_upload()
    commit_message = hub_kwargs.pop("commit_message", None)
    repo_id = hub_kwargs.pop("repo_id", os.path.basename(os.path.normpath(os.fspath(directory))))
    create_pr = hub_kwargs.pop("create_pr", False)
    repo_id = transformers_hub.hf_api().create_repo(repo_id, exist_ok=True, token=token, **hub_kwargs).repo_id
    files_timestamps = model._get_files_timestamps(directory)

    def upload():
        card = transformers_hub.create_and_tag_model_card(repo_id, model.model_tags, token=token)
        card.save(os.path.join(directory, "README.md"))
        return model._upload_modified_files(
            directory, repo_id, files_timestamps, commit_message=commit_message, token=token, create_pr=create_pr
        )

    return upload


# ----------------------------------------------------------------------------- 8. experts implementation


def check_experts_implementation_hook() -> None:
    """transformers still asks the private classmethod `_can_set_experts_implementation` whether a
    model may take an `experts_implementation` (from `_grouped_mm_can_dispatch` and
    `set_experts_implementation`)."""
    hook = inspect.getattr_static(PreTrainedModel, "_can_set_experts_implementation", None)
    if not isinstance(hook, classmethod):
        raise _changed("PreTrainedModel._can_set_experts_implementation", "a classmethod")
    for caller in ("_grouped_mm_can_dispatch", "set_experts_implementation"):
        if "_can_set_experts_implementation" not in getattr(PreTrainedModel, caller).__code__.co_names:
            raise _changed(f"PreTrainedModel.{caller}", "a call of _can_set_experts_implementation")


class PreTrainedModelWithComposedExperts(PreTrainedModel):
    """A `PreTrainedModel` whose MoE experts live in a transformers model it composes (the
    Qwen3.5-MoE backbone): it takes `experts_implementation` (`from_pretrained`'s keyword,
    `set_experts_implementation`) and hands it on to that model.

    transformers decides whether a model may set its experts implementation by looking for
    `@use_experts_implementation` in the source of the model's own module (the private classmethod
    `_can_set_experts_implementation`). A composing module has no experts of its own, so
    transformers refuses `experts_implementation="grouped_mm"` for it by name, although the backbone
    it composes runs grouped_mm by default. The override answers for the composed model, and is
    checked by `check_experts_implementation_hook` whenever it is asked."""

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        check_experts_implementation_hook()
        return True


# ----------------------------------------------------------------------------- 9. attention implementation


def check_attn_implementation_hook() -> None:
    """transformers still asks the private classmethod `_can_set_attn_implementation` whether a
    model may switch its attention implementation (from `set_attn_implementation`)."""
    hook = inspect.getattr_static(PreTrainedModel, "_can_set_attn_implementation", None)
    if not isinstance(hook, classmethod):
        raise _changed("PreTrainedModel._can_set_attn_implementation", "a classmethod")
    if "_can_set_attn_implementation" not in PreTrainedModel.set_attn_implementation.__code__.co_names:
        raise _changed("PreTrainedModel.set_attn_implementation", "a call of _can_set_attn_implementation")


class PreTrainedModelWithComposedAttention(PreTrainedModel):
    """A `PreTrainedModel` whose attention layers that follow `config._attn_implementation` are those
    of the transformers model it composes (the Qwen3.5-MoE backbone), which reach their attention
    function through transformers' attention interface.

    transformers decides whether `set_attn_implementation` may switch a model's attention by looking
    for the attention interface in the source of the model's own module whenever that module
    defines an attention class (the private classmethod `_can_set_attn_implementation`). The module
    that composes the backbone also defines the tower's attention, which always runs torch's
    scaled-dot-product attention over its own masks and caches (the decode step's), so transformers
    would refuse the switch for the backbone that takes it. The override answers for the backbone,
    and is checked by `check_attn_implementation_hook` whenever it is asked."""

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        check_attn_implementation_hook()
        return True


# ----------------------------------------------------------------------------- 10. experts implementation, per call

GROUPED_GEMM = "grouped_mm"
BATCHED_MATMULS = "batched_mm"


def check_experts_implementation_switch() -> None:
    """Setting a config's experts implementation still switches its experts at their next call:
    transformers' configs keep it in the settable property `PreTrainedConfig._experts_implementation`,
    the backbone's experts (`Qwen3_5MoeExperts`, decorated by `use_experts_implementation`) look
    it up there at every call, not once when built, and `GROUPED_GEMM` and `BATCHED_MATMULS` are
    experts functions transformers registers (`ALL_EXPERTS_FUNCTIONS`)."""
    held = inspect.getattr_static(PreTrainedConfig, "_experts_implementation", None)
    if not isinstance(held, property) or held.fset is None:
        raise _changed("PreTrainedConfig._experts_implementation", "a property with a setter")
    experts = getattr(qwen3_5_moe, "Qwen3_5MoeExperts", None)
    code = getattr(getattr(experts, "forward", None), "__code__", None)
    if code is None or not {"get_interface", "_experts_implementation"} <= set(code.co_names):
        raise _changed(
            "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeExperts.forward",
            "use_experts_implementation's forward, which looks up config._experts_implementation at every call",
        )
    registered = getattr(transformers_moe, "ALL_EXPERTS_FUNCTIONS", {})
    missing = [name for name in (GROUPED_GEMM, BATCHED_MATMULS) if name not in registered]
    if missing:
        raise _changed(
            "transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS",
            f"the experts functions {(GROUPED_GEMM, BATCHED_MATMULS)}, missing {missing}",
        )


def routed_experts(model) -> list[tuple[PreTrainedConfig, list]]:
    """The MoE experts modules of `model` that take an experts implementation (a tensor `down_proj`,
    a config with `_experts_implementation`), grouped by the config they read it from: found once
    per model, after `check_experts_implementation_switch`, and kept on the model."""
    found = getattr(model, "_drama3_routed_experts", None)
    if found is None:
        import torch

        check_experts_implementation_switch()
        groups: dict[int, tuple[PreTrainedConfig, list[torch.nn.Module]]] = {}
        for module in model.modules():
            config = getattr(module, "config", None)
            if hasattr(config, "_experts_implementation") and isinstance(getattr(module, "down_proj", None), torch.Tensor):
                groups.setdefault(id(config), (config, []))[1].append(module)
        found = model._drama3_routed_experts = list(groups.values())
    return found


@contextlib.contextmanager
def experts_on_batched_mm(model, where: Callable[[list], bool]):
    """Inside: each group of `model`'s routed experts (`routed_experts`) on transformers' grouped
    GEMM for which `where(modules)` holds computes with its batched matmuls instead; on leaving,
    also when the block raises, each group switched is put back on the grouped GEMM. A group on
    another implementation (eager, batched, ...) is left alone: a nested block changes nothing.

    transformers' public `set_experts_implementation` walks every module of the model and validates
    the choice again on each call (too slow for twice a decode step); this sets the private
    attribute the experts read, each group's once per call, guarded by
    `check_experts_implementation_switch` when a model's experts are first found."""
    switched = []
    try:
        for config, modules in routed_experts(model):
            if config._experts_implementation == GROUPED_GEMM and where(modules):
                config._experts_implementation = BATCHED_MATMULS
                switched.append(config)
        yield
    finally:
        for config in switched:
            config._experts_implementation = GROUPED_GEMM

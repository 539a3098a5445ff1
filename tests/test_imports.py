"""The package's modules import one way: each imports alone, and the import graph has no cycle.

The graph is read from the source with `ast` (top-level imports: what runs when a module is
imported; imports under `if TYPE_CHECKING:` and inside functions are not edges). A function-level
import of the package's own modules is how a cycle is hidden, so those are listed too: imports
inside functions are for optional dependencies only.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import transformers_drama3

PACKAGE = "transformers_drama3"
ROOT = Path(transformers_drama3.__file__).resolve().parent


@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. transformers_drama3.codec.mel_codec
    path: Path
    is_package: bool


def package_modules() -> dict[str, Module]:
    """Every module of the package, by dotted name (packages by their own name)."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        modules[name] = Module(name, path, is_package)
    return modules


MODULES = package_modules()


def resolve(module: Module, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The package modules an import statement of `module` imports, parents before children:
    `from .codec.mel_codec import X` gives [pkg.codec, pkg.codec.mel_codec]; `from . import name`
    gives the submodule `name` when there is one, else the package itself (its `__init__`, which
    must then have run far enough to define `name`)."""
    if isinstance(node, ast.Import):
        explicit = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        submodules = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in MODULES]
        explicit = ([source] if len(submodules) < len(node.names) else []) + submodules
    imported = []
    for target in explicit:
        parts = target.split(".")
        for end in range(1, len(parts)):
            prefix = ".".join(parts[:end])
            # importing pkg.sub runs pkg's __init__ first, unless pkg is one of the importer's own
            # parent packages (then it is already being imported)
            if prefix in MODULES and not (module.name == prefix or module.name.startswith(prefix + ".")):
                imported.append(prefix)
        if target in MODULES and target != module.name:
            imported.append(target)
    return list(dict.fromkeys(imported))


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def top_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported: the module body and what it nests
    in if/try/with blocks and class bodies, but not functions or `if TYPE_CHECKING:`."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If) and is_type_checking(node):
            pending.extend(node.orelse)
        elif isinstance(node, ast.ClassDef):
            pending.extend(node.body)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                pending.extend(getattr(node, field, []))


def function_level_imports(tree: ast.Module):
    """Import statements inside functions (they run when the function is called)."""
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield node


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules its top-level imports import."""
    graph = {}
    for name, module in MODULES.items():
        tree = ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))
        graph[name] = {target for node in top_level_imports(tree) for target in resolve(module, node)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing
    itself), each as one cycle through it: [a, b, ..., a]. Tarjan's algorithm."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [cycle_through(graph, component) for component in components]


def cycle_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One import cycle inside a strongly connected component, from its first module back to it."""
    start, members = component[0], set(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for successor in sorted(graph[path[-1]] & members):
            if successor == start:
                return path + [start]
            if successor not in seen:
                seen.add(successor)
                paths.append(path + [successor])
    raise AssertionError(f"{component} is not strongly connected")


def internal_function_imports() -> dict[tuple[str, str], list[int]]:
    """(module, package module it imports) -> lines, for every import inside a function."""
    found = {}
    for name, module in MODULES.items():
        tree = ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))
        for node in function_level_imports(tree):
            for target in resolve(module, node)[-1:]:
                found.setdefault((name, target), []).append(node.lineno)
    return found


def full_import_graph() -> dict[str, set[str]]:
    """The import graph with function-level imports as edges too."""
    graph = import_graph()
    for module, target in internal_function_imports():
        graph[module].add(target)
    return graph


def short(name: str) -> str:
    return name.removeprefix(PACKAGE + ".")


# The one kind of function-level import of the package allowed: a module that needs an optional
# extra (`serving` needs fastapi and uvicorn, the [serve] extra), imported only by the command
# that uses it, so the rest works without the extra.
OPTIONAL_EXTRA_SUBPACKAGES = ("serving",)


def needs_an_optional_extra(target: str) -> bool:
    return short(target).split(".")[0] in OPTIONAL_EXTRA_SUBPACKAGES


# ----------------------------------------------------------------------------- the graph reader


def test_the_graph_reader_resolves_relative_imports_and_finds_a_planted_cycle():
    processing = MODULES[f"{PACKAGE}.processing_drama3"]
    statement = ast.parse("from .codec.mel_codec import Drama3MelCodecModel").body[0]
    assert resolve(processing, statement) == [f"{PACKAGE}.codec", f"{PACKAGE}.codec.mel_codec"]
    codec = MODULES[f"{PACKAGE}.codec"]
    statement = ast.parse("from .. import prompting").body[0]
    assert resolve(codec, statement) == [f"{PACKAGE}.prompting"]
    statement = ast.parse("from .. import Drama3Config").body[0]  # an attribute of the package
    assert resolve(codec, statement) == [PACKAGE]
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(planted) == [["a", "b", "c", "a"], ["e", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_under_type_checking_and_inside_functions_are_not_edges():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
        "def f():\n    from .b import B\nclass C:\n    from .c import D\n"
    )
    assert [node.module for node in top_level_imports(tree)] == ["typing", "c"]
    assert [node.module for node in function_level_imports(tree)] == ["b"]


# ----------------------------------------------------------------------------- the package


def test_the_package_import_graph_has_no_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


IMPORT_EACH_ALONE = """
import importlib, json, sys, traceback
results = {}
for name in json.loads(sys.argv[1]):
    for loaded in [key for key in sys.modules if key == "transformers_drama3" or key.startswith("transformers_drama3.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        internal = (error.name or "").startswith("transformers_drama3")
        results[name] = ["error" if internal else "missing", traceback.format_exc() if internal else error.name]
    except Exception:
        results[name] = ["error", traceback.format_exc()]
print(json.dumps(results))
"""


@pytest.mark.slow
def test_each_module_imports_alone():
    """Each module is the first of the package to be imported in a clean interpreter state (the
    package's modules removed from `sys.modules` before each; torch and transformers stay loaded,
    they are not the package's). A cycle shows as a partly initialised module."""
    names = sorted(MODULES)
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_ALONE, json.dumps(names)],
        capture_output=True, text=True, timeout=600, cwd=ROOT.parent,
    )
    assert result.returncode == 0, result.stderr
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    errors = {name: detail for name, (kind, detail) in outcomes.items() if kind == "error"}
    assert not errors, "\n\n".join(f"{name}:\n{detail}" for name, detail in errors.items())
    missing = {name: detail for name, (kind, detail) in outcomes.items() if kind == "missing"}
    if missing:
        pytest.skip(f"optional dependencies not installed: {missing}")


def test_no_cycle_is_hidden_by_a_function_level_import():
    found = cycles(full_import_graph())
    report = "\n".join(" -> ".join(short(module) for module in cycle) for cycle in found)
    assert not found, "import cycles held by function-level imports:\n" + report


def test_no_package_module_is_imported_inside_a_function():
    """Imports inside functions are for optional dependencies only; a package module imported
    lazily is a cycle being hidden (or a dependency pointing the wrong way)."""
    found = {key: at for key, at in internal_function_imports().items() if not needs_an_optional_extra(key[1])}
    lines = [f"{short(module)}:{','.join(map(str, at))} -> {short(target)}" for (module, target), at in found.items()]
    assert not found, "function-level imports of the package:\n" + "\n".join(lines)


# Inside serving, the adapter code (LoRA slots) loads only in a server given adapters: the service and
# the routes import it when an adapter is first asked for.
LAZY_ADAPTER_MODULES = ("serving.adapters", "serving.adapter_routes")


def test_the_serving_subpackage_is_imported_lazily_only_where_it_is_used():
    lazy = {(short(module), short(target)) for module, target in internal_function_imports() if needs_an_optional_extra(target)}
    inside = {(module, target) for module, target in lazy if module != "cli"}
    assert all(module.startswith("serving.") and target in LAZY_ADAPTER_MODULES for module, target in inside), lazy


# ----------------------------------------------------------------------------- the console script

CONSOLE_SCRIPT = "drama3_cli"
CONSOLE_SCRIPT_PATH = ROOT.parent / f"{CONSOLE_SCRIPT}.py"


def all_imports(tree: ast.Module):
    """Every import statement, wherever it is: module level, functions, `if TYPE_CHECKING:`."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def imports_the_console_script(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == CONSOLE_SCRIPT for alias in node.names)
    return node.level == 0 and (node.module or "").split(".")[0] == CONSOLE_SCRIPT


def test_no_module_of_the_package_imports_the_console_script():
    """`drama3_cli` (beside the package) is the console script's thin front; the package never
    imports it, at module level or inside a function."""
    found = [
        f"{short(name)}:{node.lineno}"
        for name, module in MODULES.items()
        for node in all_imports(ast.parse(module.path.read_text(encoding="utf-8"), str(module.path)))
        if imports_the_console_script(node)
    ]
    assert not found, "modules importing the console script: " + ", ".join(found)


def test_no_import_cycle_through_the_console_script_at_run_time():
    """The package's graph with function-level imports as edges, plus the console script and what
    it imports (its `main` imports the package inside the function): still no cycle."""
    script = Module(CONSOLE_SCRIPT, CONSOLE_SCRIPT_PATH, is_package=False)
    tree = ast.parse(CONSOLE_SCRIPT_PATH.read_text(encoding="utf-8"), str(CONSOLE_SCRIPT_PATH))
    graph = full_import_graph()
    graph[CONSOLE_SCRIPT] = {target for node in all_imports(tree) for target in resolve(script, node)}
    assert graph[CONSOLE_SCRIPT], "the console script imports the package (the graph reader sees it)"
    for name, module in MODULES.items():
        package_tree = ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))
        if any(imports_the_console_script(node) for node in all_imports(package_tree)):
            graph[name].add(CONSOLE_SCRIPT)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(short(module) for module in cycle) for cycle in found)


def test_the_command_line_parser_imports_only_the_standard_library():
    """The console script loads `runtime.command_line` and the option schema its flags are made from (its
    `STANDALONE_MODULES`) without the package's `__init__`, so that `--help` needs no torch: each of
    them may import the standard library and the standalone modules loaded before it, nothing else."""
    import drama3_cli  # the standard library only

    names = drama3_cli.STANDALONE_MODULES
    assert names[-1] == "transformers_drama3.runtime.command_line"
    for index, name in enumerate(names):
        path = ROOT.joinpath(*name.split(".")[1:]).with_suffix(".py")
        imported = set()
        for node in all_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = name.rsplit(".", node.level)[0]
                imported.add(f"{base}.{node.module}" if node.module else base)
            else:
                imported.update([node.module] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names])
        outside = {module for module in imported
                   if module.split(".")[0] not in sys.stdlib_module_names and module not in names[:index]}
        assert not outside, f"{name} imports {sorted(outside)}"


# ----------------------------------------------------------------------------- the floors

FLOORS = (
    ("command line", ("cli", "")),  # "" is the package itself: its __init__ is the public surface
    ("serving", ("serving",)),
    ("training and evaluation", ("training", "evaluation")),
    ("runtime", ("runtime", "placement", "tiny")),
    ("model", ("modeling_drama3", "modeling_drama3_reward", "generation_drama3", "generation",
               "processing_drama3", "processing", "pipeline_drama3")),
    ("decoding", ("decoding",)),
    ("prompting", ("prompting",)),
    ("codec", ("codec", "feature_extraction_drama3")),
    ("checkpoint", ("checkpoint", "configuration_drama3")),
    ("ground", ("kernels", "layers", "integrations", "output_files")),
)
"""The package's floors, top (the console script's) to ground, each named by the top-level
modules and subpackages it holds. A module imports its own floor or the floors below it, never one
above; the architecture page (docs/architecture.md) draws the same floors."""


def floor_of(name: str, floors=FLOORS) -> int | None:
    """The floor's height (ground = 1) of a module, by its top-level module or subpackage."""
    top = "" if name == PACKAGE else short(name).split(".")[0]
    for index, (_, members) in enumerate(floors):
        if top in members:
            return len(floors) - index
    return None


def upward_imports(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """Each import that runs from a floor to one above it, as 'importer (floor) -> imported (floor)'."""
    found = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            below, above = floor_of(module, floors), floor_of(target, floors)
            if below is not None and above is not None and above > below:
                found.append(f"{short(module)} ({below}) -> {short(target)} ({above})")
    return found


def test_the_floor_check_finds_a_planted_upward_import_and_an_unplaced_module():
    floors = (("top", ("serving",)), ("ground", ("kernels",)))
    graph = {f"{PACKAGE}.kernels.planted": {f"{PACKAGE}.serving.app"}, f"{PACKAGE}.serving.app": {f"{PACKAGE}.kernels"}}
    assert upward_imports(graph, floors) == ["kernels.planted (1) -> serving.app (2)"]
    assert floor_of(f"{PACKAGE}.newcomer", floors) is None


def test_every_module_stands_on_one_floor_and_there_are_at_most_ten():
    assert len(FLOORS) <= 10
    members = [member for _, floor in FLOORS for member in floor]
    assert len(members) == len(set(members)), "a module or subpackage is on two floors"
    unplaced = sorted(short(name) for name in MODULES if floor_of(name) is None)
    assert not unplaced, f"modules on no floor (add their subpackage to FLOORS): {unplaced}"


def test_no_import_runs_from_a_floor_up_to_a_higher_one():
    """Function-level imports count too (the command line's lazy import of serving runs down)."""
    found = upward_imports(full_import_graph())
    assert not found, "imports running up a floor:\n" + "\n".join(found)


def test_the_architecture_page_draws_the_floors_the_test_holds():
    page = (ROOT.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = [line for line in page.splitlines() if line.startswith("| ") and line.count("|") == 4]
    drawn = {cells[1].strip(): cells[2].strip() for cells in (line.split("|") for line in table)}
    for name, members in FLOORS:
        assert name in drawn, f"docs/architecture.md's floor table lacks the floor {name!r}"
        for member in members:
            if member:
                assert f"`{member}" in drawn[name], f"floor {name!r} on the page lacks `{member}`"

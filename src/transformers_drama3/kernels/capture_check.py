"""Whether a function can be captured whole as one CUDA graph, checked on the CPU.

A CUDA graph replays a fixed sequence of kernels on fixed buffers. `torch.compile` hands a step to
CUDA graphs only when it is one graph (no graph break), and inductor then still refuses to capture
it (it prints "skipping cudagraphs due to ...") when the graph holds a tensor on the CPU, such as
a constant the trace created: `x[..., 0] = False` or `x[mask] = float("-inf")` put the Python
scalar into a 0-d CPU tensor (`_tensor_constant0`) that the graph reads. A graph that reads a
tensor's value on the host (`.item()`, `.tolist()`, `nonzero`, a boolean mask's shape) cannot be
replayed at all. None of this needs a GPU to see: the graph is the same on every device.

`capture_report(fn, *args, **kwargs)` compiles `fn` with `torch.compile(fullgraph=True)` and a
checking backend, on whatever device the arguments are (the CPU in CI), runs it once (so the
arguments' state advances by one call, as it would under any compile), and returns a
`CaptureReport`:

- `graph_breaks`: why dynamo could not take `fn` as one graph (`fullgraph=True` stops at the
  first; `torch._dynamo.explain` then lists them all);
- `tensor_constants`: the tensors the graph holds that are neither an argument nor a parameter or
  buffer of a module among the arguments: the get_attr nodes of the traced aten graph (after
  AOTAutograd, where a scalar written into a tensor becomes `_tensor_constant0`) and of dynamo's
  graph. Inductor counts each such constant on the device it was made on; on a GPU a CPU one
  makes it skip CUDA graphs for the whole graph;
- `host_syncs`: ops whose result the host must read (`aten._local_scalar_dense` is `.item()`,
  `nonzero`, `masked_select`, `unique`, ...: a value or a shape that depends on the data). They
  are traced into the graph, not turned into breaks (`capture_scalar_outputs` and
  `capture_dynamic_output_shape_ops` are on while checking), so the report names them;
- `mutated_inputs`: inputs the graph writes in place that are neither parameters nor marked
  static (`torch._dynamo.mark_static_address`, as transformers' static cache layers are): inductor
  skips CUDA graphs for those ("mutated inputs");
- `cpu_tensors`: when the arguments are on a device other than the CPU (CUDA, or `meta` standing in
  for it on a machine without a GPU, `cuda_paths.cuda_stand_in`), every operator of the graph that
  reads, writes or makes a tensor on the CPU: a counter or buffer left on the CPU, a constant the
  trace made there. The graph runs under a `TorchDispatchMode` that sees every operator call, each
  named with the source line of the graph node that made it. Inductor skips CUDA graphs for a
  graph with any tensor on the CPU ("skipping cudagraphs due to cpu device");
- `ops`: the number of operator calls (call_function nodes, `getitem` excluded) in the aten graph,
  an upper bound on the kernels of one step before inductor fuses them (input mutations count as
  one `copy_` each; shape arithmetic and `getitem` do not); `op_counts` by operator.

`capture_report(fn, *args, dynamic=True)` traces every size of the arguments' tensors as a symbol
(a size of 1 stays fixed, as torch specialises it): the graph torch's automatic dynamic shapes
compile once a second batch size is seen (`decoding.loop.default_compile_config`). When dynamo
traces the frame again (it restarts when it specialises a value it had made symbolic), the report
is that of its last trace.

`check_capturable(fn, *args, **kwargs)` raises `NotCapturable`, naming each problem and where in
the source it comes from, or returns the report.

The backend only reads the graphs and runs them eagerly (as `aot_eager` would): it compiles
nothing, so a check takes about as long as a trace.
"""

from __future__ import annotations

import collections
import contextlib
import operator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HOST_SYNC_OPS = frozenset({
    "aten._local_scalar_dense",  # .item(), int(t), float(t), bool(t) traced as a value
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.unique_dim",
    "aten.argwhere",
    "aten.equal",
    "aten.is_nonzero",
    "aten.allclose",
})
"""Operators (`aten.<name>`, any overload) whose result is a value or a shape the host must read
from the device; `aten.repeat_interleave.Tensor` is one too (its length is the repeats' sum)."""

HOST_SYNC_OVERLOADS = frozenset({"aten.repeat_interleave.Tensor"})

OPAQUE_HOST_SYNC_OPS = frozenset({
    "transformers.grouped_mm_fallback",  # transformers' grouped GEMM for float32 under torch.compile: reads `offs` on the host
    "drama3.chunk_gated_delta_rule_varlen",  # fla's chunked kernel on packed documents: reads `cu_seqlens` on the host
})
"""Custom operators that read a tensor on the host inside their own code, which a graph shows only
as one opaque call."""

_FUNCTIONALIZED = tuple(
    op for op in (getattr(torch.ops.higher_order, name, None) for name in ("auto_functionalized", "auto_functionalized_v2"))
    if op is not None
)
"""The wrappers functionalisation puts around a custom operator that writes its inputs in place;
the operator itself is their first argument."""

BOOKKEEPING_OPS = frozenset({
    "aten.sym_size",
    "aten.sym_stride",
    "aten.sym_numel",
    "aten.sym_storage_offset",
    "aten._assert_scalar",
    "aten.sym_constrain_range",
    "aten.sym_constrain_range_for_size",
})
"""Operators that compute shapes or check them on the host, launching nothing: not counted as ops
(they appear only beside a data-dependent value, which is reported itself)."""

_NOT_OPS = (operator.getitem,)


@dataclass
class Finding:
    """One problem: what it is and the line of source that made it (when torch recorded one)."""

    what: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.what}{' at ' + self.where if self.where else ''}"


@dataclass
class CaptureReport:
    graph_breaks: list[Finding] = field(default_factory=list)
    tensor_constants: list[Finding] = field(default_factory=list)
    host_syncs: list[Finding] = field(default_factory=list)
    mutated_inputs: list[Finding] = field(default_factory=list)
    cpu_tensors: list[Finding] = field(default_factory=list)
    device: str = "cpu"
    """The device type of the graph's inputs (the CPU unless some are elsewhere)."""
    graphs: int = 0
    ops: int = 0
    op_counts: collections.Counter = field(default_factory=collections.Counter)

    @property
    def capturable(self) -> bool:
        problems = self.graph_breaks or self.tensor_constants or self.host_syncs or self.mutated_inputs or self.cpu_tensors
        return not problems and self.graphs == 1

    def problems(self) -> list[str]:
        lines = [f"graph break: {finding}" for finding in self.graph_breaks]
        lines += [f"tensor constant created inside the graph: {finding}" for finding in self.tensor_constants]
        lines += [f"host sync: {finding}" for finding in self.host_syncs]
        lines += [f"input mutated in place but not marked static: {finding}" for finding in self.mutated_inputs]
        lines += [f"CPU tensor in a graph on {self.device}: {finding}" for finding in self.cpu_tensors]
        if not self.graph_breaks and self.graphs != 1:
            lines.append(f"{self.graphs} graphs traced, expected exactly 1")
        return lines

    def summary(self) -> str:
        return (
            f"{self.graphs} graph(s), {len(self.graph_breaks)} graph break(s), {len(self.tensor_constants)} tensor "
            f"constant(s), {len(self.host_syncs)} host sync(s), {len(self.mutated_inputs)} unmarked mutated "
            f"input(s), {len(self.cpu_tensors)} op(s) on CPU tensors (inputs on {self.device}), {self.ops} ops"
        )


class NotCapturable(RuntimeError):
    """The function cannot be captured as one CUDA graph; `report` says why."""

    def __init__(self, name: str, report: CaptureReport):
        self.report = report
        problems = "\n".join(f"  - {line}" for line in report.problems())
        super().__init__(f"{name} cannot be captured as one CUDA graph ({report.summary()}):\n{problems}")


def _packet(target) -> str | None:
    """`aten.nonzero` for the operator `aten.nonzero.default`; None for anything but an operator
    (a Python function on sizes, such as `operator.ge`)."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return str(target.overloadpacket)


def _op_name(target) -> str:
    """`aten.nonzero.default` for an operator; the name of anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def _where(node: torch.fx.Node) -> str:
    """The innermost user frame of a node's stack trace: 'file:line in function: code'."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.strip().splitlines()]
    # a trace reads 'File "...", line N, in f' then the code line; keep the last pair
    for index in range(len(frames) - 1, -1, -1):
        if frames[index].startswith("File "):
            code = frames[index + 1] if index + 1 < len(frames) else ""
            location = frames[index].replace("File ", "", 1).replace('"', "")
            return f"{location}: {code}" if code else location
    return ""


def _owned_tensor_ids(values) -> set[int]:
    """ids of every argument tensor and every parameter and buffer of an argument module (one level
    of containers and object attributes deep): the tensors a graph may legitimately hold."""
    ids: set[int] = set()
    seen: set[int] = set()

    def visit(value, depth):
        if id(value) in seen or depth > 4:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            ids.add(id(value))
        elif isinstance(value, torch.nn.Module):
            ids.update(id(tensor) for tensor in value.parameters())
            ids.update(id(tensor) for tensor in value.buffers())
        elif isinstance(value, dict):
            for item in value.values():
                visit(item, depth + 1)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)
        elif hasattr(value, "__dict__"):
            for item in vars(value).values():
                visit(item, depth + 1)
        elif hasattr(value, "__self__"):  # a bound method: its module
            visit(value.__self__, depth + 1)

    for value in values:
        visit(value, 0)
    return ids


def _attribute(module: torch.nn.Module, target: str):
    value = module
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _graph_device(values) -> str:
    """The device type of a graph's tensor inputs: the first that is not the CPU, else "cpu"."""
    types = {value.device.type for value in values if isinstance(value, torch.Tensor)}
    return next(iter(sorted(types - {"cpu"})), "cpu")


def _cpu_tensors(value) -> list[str]:
    """'shape dtype' of every CPU tensor among `value`'s leaves (arguments or results of an op)."""
    return [f"{'x'.join(map(str, leaf.shape)) or '0-d'} {leaf.dtype}" for leaf in tree_leaves(value)
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu"]


class _CpuTensorOps(TorchDispatchMode):
    """Records every operator call that reads, writes or makes a CPU tensor, with the graph node
    being run (`node`, set by `_NodeRunner`)."""

    supports_higher_order_operators = True  # functionalised custom ops (auto_functionalized_v2) pass through too

    def __init__(self):
        super().__init__()
        self.node: torch.fx.Node | None = None
        self.found: dict[tuple[str, str], Finding] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        touched = _cpu_tensors((args, kwargs)) or _cpu_tensors(result)
        if touched and str(getattr(func, "overloadpacket", func)) not in BOOKKEEPING_OPS:
            where = "" if self.node is None else _where(self.node)
            key = (str(func), where)
            if key not in self.found:
                node = "" if self.node is None else f" (node {self.node.name})"
                self.found[key] = Finding(f"{func}{node} on CPU tensor(s) {', '.join(touched)}", where)
        return result


class _NodeRunner(torch.fx.Interpreter):
    """Runs an aten graph node by node, telling `mode` which node each operator call comes from."""

    def __init__(self, gm: torch.fx.GraphModule, mode: _CpuTensorOps):
        super().__init__(gm)
        self.mode = mode

    def run_node(self, node):
        self.mode.node = node
        return super().run_node(node)


class _CheckingBackend:
    """A dynamo backend that records what makes a graph uncapturable and runs it eagerly."""

    def __init__(self, report: CaptureReport, owned: set[int]):
        self.report = report
        self.owned = owned
        self.inputs: list = []  # the real tensors of the graph being checked, in placeholder order

    def _constants(self, gm: torch.fx.GraphModule, stage: str) -> None:
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            value = _attribute(gm, node.target)
            if not isinstance(value, torch.Tensor) or id(value) in self.owned:
                continue
            shape = "x".join(map(str, value.shape)) or "0-d"
            where = _where(next(iter(node.users), node)) if node.users else _where(node)
            self.report.tensor_constants.append(
                Finding(f"{node.target} ({stage}: {shape} {value.dtype} on {value.device})", where)
            )

    def _mutations(self, gm: torch.fx.GraphModule) -> None:
        """Inputs written in place (`copy_` into a placeholder: AOTAutograd keeps an inference
        graph's input mutations as such) that are neither parameters nor marked static: inductor
        captures a graph that mutates an input only when the input keeps its address (parameters,
        buffers, `torch._dynamo.mark_static_address`), else it skips CUDA graphs ("mutated inputs")."""
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        if len(placeholders) != len(self.inputs):
            return  # AOTAutograd regrouped the inputs (aliased inputs): no one-to-one map to check
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default:
                continue
            target = node.args[0]
            if not isinstance(target, torch.fx.Node) or target.op != "placeholder":
                continue
            value = self.inputs[placeholders.index(target)]
            static = isinstance(value, torch.nn.Parameter) or getattr(value, "_dynamo_static_input_type", None)
            if isinstance(value, torch.Tensor) and not static:
                shape = "x".join(map(str, value.shape)) or "0-d"
                self.report.mutated_inputs.append(Finding(f"input {target.name} ({shape} {value.dtype})", _where(node)))

    def _aten_graph(self, gm: torch.fx.GraphModule, example_inputs):
        self.report.device = _graph_device(self.inputs)
        self._constants(gm, "aten graph")
        self._mutations(gm)
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target in _NOT_OPS:
                continue
            target = node.args[0] if node.target in _FUNCTIONALIZED else node.target
            packet, name = _packet(target), _op_name(target)
            # an op whose output size or value is a new symbol (unbacked) depends on the data:
            # boolean-mask indexing, nonzero, .item(), ... whichever operator it is
            data_dependent = bool(node.meta.get("unbacked_bindings"))
            if packet in HOST_SYNC_OPS or packet in OPAQUE_HOST_SYNC_OPS or name in HOST_SYNC_OVERLOADS or data_dependent:
                self.report.host_syncs.append(Finding(name, _where(node)))
            if packet is None or packet in BOOKKEEPING_OPS:
                continue
            self.report.ops += 1
            self.report.op_counts[name] += 1
        if self.report.device == "cpu":
            return gm.forward if hasattr(gm, "forward") else gm
        return self._runner_naming_cpu_tensors(gm)

    def _runner_naming_cpu_tensors(self, gm: torch.fx.GraphModule):
        """The graph, run node by node under `_CpuTensorOps`: what touches a CPU tensor goes into
        the report."""
        report = self.report

        def run(*args):
            mode = _CpuTensorOps()
            # FakeTensors (on "cuda" without a GPU): the graph's own factory calls make fakes too
            fake_mode = torch._guards.detect_fake_mode(args) or contextlib.nullcontext()
            with fake_mode, mode:
                result = _NodeRunner(gm, mode).run(*args)
            report.cpu_tensors.extend(mode.found.values())
            return result

        return run

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        if self.report.graphs:
            # under fullgraph a second call is dynamo tracing the same frame again (it restarts its
            # analysis when it specialises a value it had traced symbolically): only the last trace runs
            self.report.__dict__.update(vars(CaptureReport()))
        self.report.graphs = 1
        self.inputs = list(example_inputs)
        self._constants(gm, "dynamo graph")

        def compiler(aten_gm, aten_inputs):
            return make_boxed_func(self._aten_graph(aten_gm, aten_inputs))

        # input mutations kept in the graph as `copy_`, as inductor keeps them
        checking = aot_autograd(fw_compiler=compiler, inference_compiler=compiler, keep_inference_input_mutations=True)
        return checking(gm, example_inputs)


def capture_report(fn, *args, dynamic: bool = False, **kwargs) -> CaptureReport:
    """Compile `fn` (fullgraph, checking backend), call it once with `args` and `kwargs` under
    `torch.no_grad()` (a decode step is inference: one graph, no backward), and report its graph
    breaks, tensor constants, host syncs and ops (see the module docstring).

    Resets dynamo's caches before and after (so `fn` is traced afresh, whatever was compiled
    before, and nothing compiled here stays). When the trace breaks, `fn` has not run yet;
    `torch._dynamo.explain` then runs it once to list every break."""
    report = CaptureReport()
    owned = _owned_tensor_ids((*args, *kwargs.values(), getattr(fn, "__self__", None)))
    backend = _CheckingBackend(report, owned)
    torch._dynamo.reset()
    patches = dict(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)
    try:
        with torch.no_grad(), torch._dynamo.config.patch(**patches):
            try:
                torch.compile(fn, fullgraph=True, dynamic=dynamic, backend=backend)(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed:
                raise  # the checker's own failure, not the function's
            except Exception as error:  # noqa: BLE001 - dynamo re-raises some trace failures as they were
                if report.graphs:
                    raise  # traced whole, then failed running: the function's own error
                # fullgraph stops at the first break, before anything ran
                report.graph_breaks = _every_break(fn, args, kwargs) or [Finding(_first_line(error))]
    finally:
        torch._dynamo.reset()
    return report


def _every_break(fn, args, kwargs) -> list[Finding]:
    """Every graph break of `fn`, from `torch._dynamo.explain` (which runs it)."""
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(fn)(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a function dynamo cannot even run piecewise: report the first break
        return []
    findings = []
    for reason in explained.break_reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = "" if frame is None else f"{frame.filename}, line {frame.lineno}, in {frame.name}"
        if frame is not None and frame.line:
            where += f": {frame.line.strip()}"
        findings.append(Finding(reason.reason.strip().splitlines()[0], where))
    return findings


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    head = lines[0] if lines else type(error).__name__
    # dynamo names the user frame as 'File "...", line N, in f'; keep it when present
    frame = next((line.strip() for line in lines if line.strip().startswith("File ")), "")
    return f"{head} ({frame})" if frame else head


def check_capturable(fn, *args, **kwargs) -> CaptureReport:
    """`capture_report`, raising `NotCapturable` (naming each problem) unless `fn` traced as one
    graph with no break, no tensor constant, no host sync and no unmarked input mutation."""
    report = capture_report(fn, *args, **kwargs)
    if not report.capturable:
        raise NotCapturable(getattr(fn, "__qualname__", repr(fn)), report)
    return report

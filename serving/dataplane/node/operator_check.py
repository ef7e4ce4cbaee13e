"""Which operators an artifact's code may call: an allow-list checked before the model runs.

A registered model calls operators, and some operators registered in every torch process reach outside
the tensor world: `aten::from_file` reads (and with shared=True writes) any file the process can reach,
`aten::save` writes one. This is the second wall (the first is the sandboxed runtime process): the
operator names an artifact's code can call are collected and checked against a policy.

The policy is an allow-list, not a deny-list. Operators live in namespaces (`aten::add`), and any
library loaded into the process can register more of them (torch itself ships c10d, symm_mem,
profiler, mkldnn, inductor, static_runtime...): a deny-list would have to know every side-effecting
operator of every namespace present now or after an upgrade. So only `aten`, `prim` and `quantized`
are allowed (everything torch's standard networks emit in TorchScript and torch.export: MLPs,
convnets, LSTM/GRU, transformer encoder layers, dynamic and static torch.ao quantization, frozen and
optimize_for_inference graphs), plus chosen higher-order ops, plus namespaces the platform admin
names in FERRY_ALLOWED_OPERATOR_NAMESPACES. Inside the allowed namespaces, DENIED refuses what touches
files, processes, the network, threads or process-global state. It was found by listing every
registered schema (`torch._C._jit_get_all_schemas()`, torch 2.13): `aten::from_file` and
`aten::save` are the only ones in aten/prim/quantized with a file name argument
(tests/test_operator_check.py keeps checking that), and the rest by name (seed, thread, print, rpc,
fork, wait, cache...). Any other name containing "file", "save" or "load" in an allowed namespace is
refused as well, so a future `aten::_load_*` is refused before anyone reads its schema.

Decided and not refused: `aten::warn` (Python's warning machinery; torch.nn's own scripted code
emits it), `prim::RaiseException` (the error path of every standard module), `aten::set_grad_enabled`
(thread-local autograd mode; `torch.no_grad()` in scripted code), `prim::TimePoint` (reads a
clock), `aten::seed`/`aten::initial_seed` (on a Generator the model was given).

TorchScript is checked twice. Before it is compiled, its code is read as data
(serving.dataplane.node.archive_check.check_torchscript_code): a denied operator's name anywhere in it,
an operator outside the allowed namespaces, or a TorchBind class outside TORCHBIND_NAMESPACES refuses
the archive, so no `__setstate__` that could call one runs. Then it is walked from its compiled code:
every function of the archive's compilation unit (module methods of every submodule, TorchScript class
methods such as `__setstate__`, free functions), including nested blocks (prim::If, prim::Loop) and
subgraphs (prim::fork); given a module alone, its methods' graphs are inlined so that the calls they
make are followed. TorchBind classes (C++ classes in `torch.classes`) are named
`torch.classes.<namespace>.<Class>.<method>` and judged by their namespace. A torch.export program is
read from its JSON (the archive check reads the same document), higher-order ops' subgraphs
included. Plain Python and torch; the Django side passes the setting in.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch

ALLOWED_NAMESPACES = frozenset(("aten", "prim", "quantized"))

# The environment variable behind the setting of the same name (config/settings.py): processes that do
# not load Django settings (the sandboxed runtime process, a node's loader) read it from here.
NAMESPACES_ENV = "FERRY_ALLOWED_OPERATOR_NAMESPACES"

# torch.export's higher-order ops, allowed one by one: control flow and wrappers whose bodies are
# subgraphs of the same program (checked too) or whose operator argument is checked (auto_functionalized,
# with_effects). Not call_torchbind, print, triton kernels, executorch delegates, run_const_graph...
HIGHER_ORDER = "higher_order"
ALLOWED_HIGHER_ORDER = frozenset(
    (
        "cond",
        "while_loop",
        "map_impl",
        "scan",
        "associative_scan",
        "invoke_subgraph",
        "out_dtype",
        "auto_functionalized",
        "auto_functionalized_v2",
        "with_effects",
        "wrap_with_set_grad_enabled",
        "wrap_with_autocast",
        "hints_wrapper",
        "flex_attention",
    )
)

# Refused inside the allowed namespaces, with why. Some are not registered in torch 2.13 (set_num_threads,
# set_num_interop_threads): refused should a later torch register them.
DENIED = {
    "aten::from_file": "reads a file, and with shared=True creates and writes it",
    "aten::save": "writes a file",
    "prim::Print": "writes to the node process's stdout (its log stream); no standard net prints",
    "aten::_print": "writes to the node process's stdout",
    "aten::manual_seed": "reseeds the process-global random generator that other models sample from",
    "aten::set_num_threads": "changes the process's intra-op thread count",
    "aten::set_num_interop_threads": "changes the process's inter-op thread count",
    "aten::_cufft_set_plan_cache_max_size": "resizes the process-global cuFFT plan cache",
    "aten::_cufft_clear_plan_cache": "clears the process-global cuFFT plan cache",
    "prim::fork": "starts a task on the inter-op thread pool that can outlive the call",
    "prim::forkClosure": "starts a task on the inter-op thread pool",
    "aten::wait": "waits on a forked task",
    "prim::awaitable": "defers work past the call",
    "prim::awaitable_nowait": "defers work past the call",
    "prim::awaitable_wait": "waits on deferred work",
    "prim::rpc_async": "calls another process over the network (torch.distributed.rpc)",
    "prim::rpc_sync": "calls another process over the network",
    "prim::rpc_remote": "calls another process over the network",
    "prim::PythonOp": "calls a Python function",
}
FILE_LIKE = re.compile(r"file|save|load")
# How TorchScript code names each denied operator: its own name (`torch.from_file`, `ops.prim.Print`, the
# special forms `fork` and `awaitable`), and `print` for prim::Print. The archive check refuses code that holds
# any of these words before the code is compiled (serving.dataplane.node.archive_check.check_torchscript_code).
DENIED_NAMES = {operator.split("::", 1)[1]: operator for operator in DENIED} | {"print": "prim::Print"}
# TorchBind (C++) classes an archive may hold objects of (built, by their C++ `__setstate__`, while it loads):
# the allowed namespaces' and `rnn`, whose CellParamsBase holds a dynamically quantized RNN's packed weights.
TORCHBIND_NAMESPACES = ALLOWED_NAMESPACES | {"rnn"}

CUSTOM_CLASS_PREFIX = "__torch__.torch.classes."
TORCHBIND_NAME = "torch.classes."


class OperatorRefused(Exception):
    """The artifact calls operators the policy does not allow; the message names them."""

    def __init__(self, operators: Iterable[str]) -> None:
        self.operators = sorted(set(operators))
        self.reason = f"operator not allowed: {', '.join(self.operators)}"
        super().__init__(self.reason)


def configured_namespaces() -> frozenset[str]:
    """The admin's extra namespaces from the environment (comma list), as config/settings.py reads them."""
    return parse_namespaces(os.environ.get(NAMESPACES_ENV, ""))


def parse_namespaces(value: str | Iterable[str]) -> frozenset[str]:
    items = value.split(",") if isinstance(value, str) else value
    return frozenset(item.strip() for item in items if item.strip())


def namespace_of(operator: str) -> str:
    if operator.startswith(TORCHBIND_NAME):
        return operator[len(TORCHBIND_NAME) :].split(".", 1)[0]
    return operator.split("::", 1)[0]


def allowed(operator: str, extra_namespaces: Iterable[str] = ()) -> bool:
    if operator in DENIED:
        return False
    namespace = namespace_of(operator)
    name = operator.split("::", 1)[-1]
    if namespace == HIGHER_ORDER and name in ALLOWED_HIGHER_ORDER:
        return True
    if namespace in ALLOWED_NAMESPACES:
        return not FILE_LIKE.search(name)
    return namespace in set(extra_namespaces)


def refused(operators: Iterable[str], extra_namespaces: Iterable[str] | None = None) -> list[str]:
    """The operators the policy refuses, sorted; `extra_namespaces` defaults to the environment's setting."""
    extra = configured_namespaces() if extra_namespaces is None else parse_namespaces(extra_namespaces)
    return sorted({op for op in operators if not allowed(op, extra)})


def check(operators: Iterable[str], extra_namespaces: Iterable[str] | None = None) -> None:
    bad = refused(operators, extra_namespaces)
    if bad:
        raise OperatorRefused(bad)


# --- TorchScript ----------------------------------------------------------------------------------


def load_torchscript(source: Path | BinaryIO, map_location: torch.device) -> tuple[torch.jit.ScriptModule, set[str]]:
    """`torch.jit.load`, keeping the compilation unit it compiles the archive's code into, and the operator
    names of all that code: the CU holds every function of the archive, among them TorchScript class
    methods that no module method reaches (a class's `__setstate__` runs while loading). These are the
    calls torch.jit.load makes (torch/jit/_serialization.py), with its own compilation unit instead of a
    throwaway one. Loading runs `__setstate__` code: call this where that is contained (the sandboxed
    process), and check the names before running anything else."""
    unit = torch._C.CompilationUnit()
    if isinstance(source, Path):
        cpp_module = torch._C.import_ir_module(unit, str(source), map_location, {}, False)
    else:
        cpp_module = torch._C.import_ir_module_from_buffer(unit, source.read(), map_location, {}, False)
    module = torch.jit._recursive.wrap_cpp_module(cpp_module)
    return module, torchscript_operators(module, unit)


def torchscript_operators(module: torch.jit.ScriptModule, unit: torch._C.CompilationUnit | None = None) -> set[str]:
    """The node kinds of every function in `unit` (the compilation unit the module was loaded into: its
    modules' methods and hooks, TorchScript class methods, free functions), each graph as compiled, since
    every function it calls is in the unit and walked in its own right. Without the unit: of every method
    of the module and its submodules (hooks included), each on an inlined copy so that calls to TorchScript
    functions and class methods are followed (inlining every graph of a unit instead costs a second on a
    transformer layer, whose forward inlines most of the others)."""
    graphs: list[torch.Graph] = []
    if unit is not None:
        graphs += [function.graph for function in unit.get_functions()]  # the modules' methods among them
    else:
        for _, sub in module.named_modules():
            cpp = sub._c
            graphs += [cpp._get_method(name).graph for name in cpp._method_names()]
            graphs += [hook.graph for hook in (*cpp._get_forward_hooks(), *cpp._get_forward_pre_hooks())]
    found: set[str] = set()
    for graph in graphs:
        if unit is None:
            inlined = graph.copy()
            try:
                torch._C._jit_pass_inline(inlined)
                graph = inlined
            except RuntimeError:
                pass  # torch's inliner asserts on some graphs (a prim::fork of a function): walked as compiled
        _collect(graph.block(), found)
    return found


def _collect(block: torch.Block, found: set[str]) -> None:
    for node in block.nodes():
        kind = node.kind()
        found.add(kind)
        if kind in ("prim::CallMethod", "prim::CreateObject"):
            value = node.output() if kind == "prim::CreateObject" else next(node.inputs())
            qualified = getattr(value.type(), "qualified_name", lambda: "")()
            if qualified.startswith(CUSTOM_CLASS_PREFIX):  # a TorchBind (C++) class: what it calls is its own
                method = node.s("name") if node.hasAttribute("name") else "__new__"
                found.add(f"{TORCHBIND_NAME}{qualified[len(CUSTOM_CLASS_PREFIX) :]}.{method}")
        for inner in node.blocks():
            _collect(inner, found)
        for attribute in node.attributeNames():
            if node.kindOf(attribute) == "g":  # prim::fork, prim::awaitable and fusion groups hold subgraphs
                _collect(node.g(attribute).block(), found)


# --- torch.export ---------------------------------------------------------------------------------


def export_operators(program: Any) -> set[str]:
    """The operators a serialised ExportedProgram (models/model.json, parsed) calls: every `target` and
    `as_operator` (auto_functionalized's and with_effects' operator argument) of the graph and of its
    subgraphs (higher-order ops' branches and bodies), `torch.ops.aten.add.Tensor` as `aten::add`. The
    size arithmetic export emits (`_operator.add`, `torch.sym_max`...) is not an operator; the archive
    check accepts only its fixed list."""
    found: set[str] = set()
    _targets(program, found)
    return found


def operator_name(target: str) -> str | None:
    parts = target.split(".")
    if len(parts) >= 4 and parts[:2] == ["torch", "ops"]:
        return f"{parts[2]}::{parts[3]}"
    return None


def _targets(value: Any, found: set[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("target", "as_operator") and isinstance(item, str):
                name = operator_name(item)
                if name:
                    found.add(name)
            else:
                _targets(item, found)
    elif isinstance(value, list):
        for item in value:
            _targets(item, found)

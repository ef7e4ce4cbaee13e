"""Pipelines of models: the graph a pipeline's spec describes, its type check, and the row arithmetic of
its nodes (a switch's condition, an ensemble's combination, a splitter's choice).

Plain Python and numpy: no Django, no snapshot types. The control plane checks a spec with `check` at
registration (and again whenever it builds a snapshot); the data plane's executor
(`serving.dataplane.gateway.pipeline`) walks the same graph.

A spec is JSON. Each node is an object with exactly one kind key, after KServe's InferenceGraph:

    {"model": "digits-small", "name": "small", "version": 2, "inputs": {"input": "request.input"}}
    {"sequence": [node, node, ...]}
    {"switch": {"tensor": "scores", "reduce": "max_softmax", "op": "<", "value": 0.9}, "then": node, "else": node}
    {"ensemble": [node, node, ...], "combine": "mean" | "vote" | "concat"}
    {"splitter": [{"weight": 0.9, "node": node}, {"weight": 0.1, "node": node}]}

Data flows as named tensors, one row per request row. A node reads its *current* tensors (the request's for
the first node, else the response of the node before it in a sequence) and answers a *response*. A model
step's inputs default to the tensors of the same name; `inputs` maps an input to another: "request.X" (the
request's tensor X), "S.X" (the response of the named node S that has already run on every row that reaches
this step) or "X" (the current tensors' X, else the request's). The request's signature is derived from what the
steps read from it; the pipeline's outputs are its root node's response.

- switch: rows whose condition holds go to `then`, the others to `else` (default: the current tensors pass
  through unchanged); both must answer the same tensors.
- ensemble: every member answers the same current tensors, in parallel; each response tensor is combined
  across members: `mean` (elementwise), `vote` (per class, the share of members whose top class it is),
  `concat` (along the last axis).
- splitter: one branch per request, chosen by weight.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KINDS = ("model", "sequence", "switch", "ensemble", "splitter")
COMBINES = ("mean", "vote", "concat")
REDUCES = ("max", "min", "mean", "max_softmax")
OPS = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal}
FLOATS = ("FP16", "FP32", "FP64", "BF16")
NUMERIC = (*FLOATS, "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")
# What a condition reduces and `mean` and `vote` compute on: every numeric type but BF16, whose tensors travel
# as their bits (uint16; numpy has no bfloat16), so arithmetic on them here would be on the bits.
ARITHMETIC = tuple(t for t in NUMERIC if t != "BF16")
REQUEST = "request"
STEP_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_NODES = 64  # a pipeline is a handful of steps; a bound keeps the check and the snapshot small
MAX_DEPTH = 16
MAX_VERSION = 2**31 - 1  # a version is a PositiveIntegerField: a larger number names none, and would not query


class PipelineError(ValueError):
    """A spec that cannot run: `step` and `tensor` name where (either may be empty)."""

    def __init__(self, message: str, step: str = "", tensor: str = "") -> None:
        where = f"step '{step}'" if step else "pipeline"
        if tensor:
            where += f", tensor '{tensor}'"
        super().__init__(f"{where}: {message}")
        self.message = f"{where}: {message}"
        self.step = step
        self.tensor = tensor


class CombineError(ValueError):
    """Answers the row arithmetic cannot join at call time: an ensemble's members that answer other tensors,
    shapes or datatypes than each other, or a switch's condition on a tensor with no values. The check rules
    these out for the versions it saw; a version routed to since (a canary, an arm, a pin) may still answer
    otherwise, so the executor turns this into an answer. `tensor` names the tensor; the message names no
    model."""

    def __init__(self, message: str, tensor: str = "") -> None:
        where = f"tensor '{tensor}': " if tensor else ""
        super().__init__(f"{where}{message}")
        self.message = f"{where}{message}"
        self.tensor = tensor


@dataclass(frozen=True, slots=True)
class Tensor:
    """A tensor's type after the batch dimension: -1 is a variable dimension, up to `max_shape`."""

    datatype: str
    shape: tuple[int, ...]
    max_shape: tuple[int, ...] | None = None

    def describe(self) -> str:
        return f"{self.datatype} {list(self.shape)}"

    def to_dict(self, name: str) -> dict[str, Any]:
        d: dict[str, Any] = {"name": name, "datatype": self.datatype, "shape": list(self.shape)}
        if -1 in self.shape and self.max_shape is not None:
            d["max_shape"] = list(self.max_shape)
        return d

    @property
    def variable(self) -> bool:
        return -1 in self.shape


Signature = dict[str, Tensor]


@dataclass(frozen=True, slots=True)
class ModelSignature:
    """What the check knows of a step's model: the inputs and outputs of the version it would serve."""

    inputs: Signature
    outputs: Signature
    max_batch_size: int = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Condition:
    tensor: str  # a reference, as a model step's inputs
    reduce: str
    op: str
    value: float

    def rows(self, values: np.ndarray) -> np.ndarray:
        """One bool per row: whether the condition holds for it. `CombineError` for rows with no values (a
        variable dimension answered empty): there is nothing to reduce."""
        if values.ndim and values.shape[0] == 0:
            return np.zeros(0, dtype=bool)
        if values.size == 0:
            raise CombineError("the switch's condition has no values to reduce", self.tensor)
        flat = values.reshape(values.shape[0], -1).astype(np.float64, copy=False) if values.ndim else values
        if self.reduce == "max_softmax":
            last = values.astype(np.float64).reshape(values.shape[0], -1, values.shape[-1] if values.ndim > 1 else 1)
            shifted = np.exp(last - last.max(axis=-1, keepdims=True))
            reduced = (shifted / shifted.sum(axis=-1, keepdims=True)).reshape(values.shape[0], -1).max(axis=1)
        elif self.reduce == "max":
            reduced = flat.max(axis=1)
        elif self.reduce == "min":
            reduced = flat.min(axis=1)
        else:
            reduced = flat.mean(axis=1)
        chosen: np.ndarray = OPS[self.op](reduced, self.value)
        return chosen


@dataclass(frozen=True, slots=True)
class Node:
    kind: str
    name: str = ""  # "" : not referable
    # model
    model: str = ""
    version: int | None = None
    inputs: tuple[tuple[str, str], ...] = ()  # (model input, reference)
    # sequence, ensemble: the members; switch: (then, else?); splitter: the branches
    children: tuple[Node, ...] = ()
    weights: tuple[float, ...] = ()  # splitter
    combine: str = ""  # ensemble
    condition: Condition | None = None  # switch
    has_else: bool = False  # switch

    def label(self) -> str:
        return self.name or self.kind

    def walk(self) -> list[Node]:
        """This node and every node under it, depth first."""
        out = [self]
        for child in self.children:
            out.extend(child.walk())
        return out

    def steps(self) -> list[Node]:
        return [n for n in self.walk() if n.kind == "model"]


@dataclass(frozen=True, slots=True)
class Checked:
    """A spec that passed `check`: its graph and the signature a client calls it with."""

    root: Node
    inputs: Signature  # in order of first use
    outputs: Signature
    max_rows: int  # the smallest max_batch_size of its steps
    models: tuple[str, ...]  # the models its steps name, in order, once each
    splits: dict[str, tuple[float, ...]] = field(default_factory=dict)  # splitter -> cumulative weights


# -- parsing ---------------------------------------------------------------------------------------


def parse(spec: object) -> Node:
    """The graph of a JSON spec; `PipelineError` for anything malformed. Names are checked unique."""
    counter = [0]
    root = _parse(spec, counter, 0, "")
    names = [n.name for n in root.walk() if n.name]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise PipelineError("two nodes have this name: name them apart with 'name'", step=name)
        if name == REQUEST:
            raise PipelineError(f"'{REQUEST}' is the request's own name", step=name)
        seen.add(name)
    return root


def _parse(spec: object, counter: list[int], depth: int, where: str) -> Node:
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise PipelineError(f"more than {MAX_NODES} nodes")
    if depth > MAX_DEPTH:
        raise PipelineError(f"nested deeper than {MAX_DEPTH}")
    if not isinstance(spec, dict):
        raise PipelineError(f"a node must be an object with one of {', '.join(KINDS)}", step=where)
    kinds = [k for k in KINDS if k in spec]
    if len(kinds) != 1:
        raise PipelineError(f"a node must have exactly one of {', '.join(KINDS)}", step=where)
    kind = kinds[0]
    name = spec.get("name", "")
    if name != "" and (not isinstance(name, str) or not STEP_NAME.match(name)):
        raise PipelineError("a node's name uses letters, digits, '_' and '-' (up to 64)", step=str(name)[:64])
    allowed = {
        "model": {"model", "name", "version", "inputs"},
        "sequence": {"sequence", "name"},
        "switch": {"switch", "then", "else", "name"},
        "ensemble": {"ensemble", "combine", "name"},
        "splitter": {"splitter", "name"},
    }[kind]
    extra = sorted(set(spec) - allowed)
    if extra:
        raise PipelineError(f"a {kind} node takes no {extra[0]!r}", step=name or where)
    if kind == "model":
        return _parse_model(spec, name)
    label = name or where or kind
    if kind == "sequence":
        members = spec["sequence"]
        if not isinstance(members, list) or not members:
            raise PipelineError("'sequence' must be a non-empty list of nodes", step=label)
        children = tuple(_parse(m, counter, depth + 1, label) for m in members)
        return Node("sequence", name, children=children)
    if kind == "switch":
        condition = _parse_condition(spec["switch"], label)
        if "then" not in spec:
            raise PipelineError("a switch needs 'then'", step=label)
        branches_ = [_parse(spec["then"], counter, depth + 1, label)]
        if "else" in spec:
            branches_.append(_parse(spec["else"], counter, depth + 1, label))
        return Node("switch", name, children=tuple(branches_), condition=condition, has_else="else" in spec)
    if kind == "ensemble":
        members = spec["ensemble"]
        if not isinstance(members, list) or len(members) < 2:
            raise PipelineError("'ensemble' must list at least two nodes", step=label)
        combine = spec.get("combine", "mean")
        if combine not in COMBINES:
            raise PipelineError(f"'combine' must be one of {', '.join(COMBINES)}", step=label)
        children = tuple(_parse(m, counter, depth + 1, label) for m in members)
        return Node("ensemble", name, children=children, combine=combine)
    branches = spec["splitter"]
    if not isinstance(branches, list) or len(branches) < 2:
        raise PipelineError("'splitter' must list at least two {weight, node} branches", step=label)
    weights: list[float] = []
    picks: list[Node] = []
    for branch in branches:
        if not isinstance(branch, dict) or set(branch) != {"weight", "node"}:
            raise PipelineError('each splitter branch is {"weight": w, "node": node}', step=label)
        w = branch["weight"]
        if type(w) not in (int, float) or not 0 < w <= 1:
            raise PipelineError("a splitter weight is a number in (0, 1]", step=label)
        weights.append(float(w))
        picks.append(_parse(branch["node"], counter, depth + 1, label))
    if abs(sum(weights) - 1.0) > 1e-6:
        raise PipelineError(f"splitter weights sum to {sum(weights):g}, not 1", step=label)
    return Node("splitter", name, children=tuple(picks), weights=tuple(weights))


def _parse_model(spec: dict[str, Any], name: str) -> Node:
    model = spec["model"]
    if not isinstance(model, str) or not model or len(model) > 100:
        raise PipelineError("'model' must be a model's name", step=name)
    if not name:
        if not STEP_NAME.match(model):
            raise PipelineError("give this step a 'name': its model's name cannot name a step", step=model[:64])
        name = model
    version = spec.get("version")
    if version is not None and (type(version) is not int or not 1 <= version <= MAX_VERSION):
        raise PipelineError(f"'version' must be an integer from 1 to {MAX_VERSION}", step=name)
    raw = spec.get("inputs", {})
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in raw.items()):
        raise PipelineError("'inputs' maps each input's name to a tensor reference (strings)", step=name)
    return Node("model", name, model=model, version=version, inputs=tuple(sorted(raw.items())))


def _parse_condition(raw: object, label: str) -> Condition:
    if not isinstance(raw, dict) or not {"tensor", "op", "value"} <= set(raw) <= {"tensor", "reduce", "op", "value"}:
        raise PipelineError('a switch is {"tensor": t, "reduce": r, "op": "<", "value": v}', step=label)
    tensor, reduce, op, value = raw["tensor"], raw.get("reduce", "max"), raw["op"], raw["value"]
    if not isinstance(tensor, str) or not tensor:
        raise PipelineError("the switch's 'tensor' must be a tensor reference", step=label)
    if reduce not in REDUCES:
        raise PipelineError(f"the switch's 'reduce' must be one of {', '.join(REDUCES)}", step=label)
    if op not in OPS:
        raise PipelineError(f"the switch's 'op' must be one of {', '.join(OPS)}", step=label)
    try:
        # float() of an int past the float range overflows (JSON's 10**400): not finite either.
        number = float(value) if type(value) in (int, float) else math.nan
    except OverflowError:
        number = math.nan
    if not math.isfinite(number):
        raise PipelineError("the switch's 'value' must be a finite number", step=label)
    return Condition(tensor, reduce, op, number)


# -- the type check --------------------------------------------------------------------------------


def split_reference(reference: str, scope: Mapping[str, object]) -> tuple[str | None, str]:
    """(source, tensor) of a reference: source "request", a named node in `scope`, or None for the
    current tensors."""
    head, dot, rest = reference.partition(".")
    if dot and rest and (head == REQUEST or head in scope):
        return head, rest
    return None, reference


def connects(have: Tensor, need: Tensor) -> bool:
    """Whether a tensor of type `have` can feed an input declared `need`: the same datatype and rank, and
    each dimension equal or variable on the input's side (within its maximum)."""
    if have.datatype != need.datatype or len(have.shape) != len(need.shape):
        return False
    need_max = need.max_shape or need.shape
    have_max = have.max_shape or have.shape
    for h, n, hm, nm in zip(have.shape, need.shape, have_max, need_max, strict=True):
        if n == -1:
            if (hm if h == -1 else h) > nm:
                return False
        elif h != n:
            return False
    return True


class _Checker:
    def __init__(self, signatures: Callable[[str, int | None], ModelSignature | None], names: set[str]) -> None:
        self.signatures = signatures
        self.names = names  # every named node of the graph
        self.request: Signature = {}
        self.max_rows = 2**31 - 1
        self.models: list[str] = []

    def node(self, node: Node, current: Signature | None, scope: dict[str, Signature]) -> Signature:
        """The response of `node` given its current tensors (None: the request's, still open)."""
        response: Signature | None
        if node.kind == "model":
            response = self.model(node, current, scope)
        elif node.kind == "sequence":
            response = current
            for child in node.children:
                response = self.node(child, response, scope)
        elif node.kind == "switch":
            response = self.switch(node, current, scope)
        elif node.kind == "ensemble":
            response = self.ensemble(node, current, scope)
        else:
            response = self.splitter(node, current, scope)
        assert response is not None
        if node.name:
            scope[node.name] = response
        return response

    def resolve(self, reference: str, current: Signature | None, scope: dict[str, Signature]) -> Tensor | None:
        source, tensor = split_reference(reference, scope)
        if source == REQUEST or (source is None and current is None):
            return self.request.get(tensor)
        if source is not None:
            return scope[source].get(tensor)
        # A bare name: the current tensors', else the request's (a step after the first reads the request's
        # tensors without naming it, as "digits-small, then digits where it is unsure" needs).
        return current.get(tensor, self.request.get(tensor))  # type: ignore[union-attr]

    def unrun(
        self, reference: str, current: Signature | None, scope: dict[str, Signature], label: str, tensor: str
    ) -> None:
        """Refuse a written reference `S.X` whose S has not run before it: S names a node of the graph out of
        scope (later, or in another branch), or none at all (a misspelling). Read as a bare name it would
        become a request tensor called "S.X" that no client sends; a request tensor with a dot in its name
        is written `request.S.X`."""
        head, dot, rest = reference.partition(".")
        if not dot or not rest or head == REQUEST or head in scope:
            return
        if head in self.names:
            raise PipelineError(f"reads '{reference}', but step '{head}' has not run before this step", label, tensor)
        if self.resolve(reference, current, scope) is None:  # not a tensor of that name either
            raise PipelineError(
                f"reads '{reference}', but no step '{head}' has run before this step (a request tensor of that"
                f" name is written 'request.{reference}')",
                label,
                tensor,
            )

    def model(self, node: Node, current: Signature | None, scope: dict[str, Signature]) -> Signature:
        signature = self.signatures(node.model, node.version)
        if signature is None:  # unknown, or another tenant's and not visible: the same words either way
            version = f" version {node.version}" if node.version is not None else ""
            raise PipelineError(f"no model of that name{version} is visible to this pipeline's tenant", step=node.name)
        if node.model not in self.models:
            self.models.append(node.model)
        self.max_rows = min(self.max_rows, signature.max_batch_size)
        mapped = dict(node.inputs)
        unknown = sorted(set(mapped) - set(signature.inputs))
        if unknown:
            raise PipelineError("the model has no input of this name", step=node.name, tensor=unknown[0])
        for input_name, need in signature.inputs.items():
            reference = mapped.get(input_name, input_name)
            if input_name in mapped:  # as written; an input's own name is read as it is
                self.unrun(reference, current, scope, node.name, input_name)
            source, tensor = split_reference(reference, scope)
            from_request = source == REQUEST or (source is None and current is None)
            have = self.resolve(reference, current, scope)
            if have is None and from_request:
                self.request[tensor] = need  # the request's signature grows by what its steps read from it
                continue
            if have is None:
                origin = source or "the step before it"
                raise PipelineError(
                    f"needs {need.describe()}, and {origin} has no tensor '{tensor}'", node.name, input_name
                )
            if not connects(have, need):
                origin = "the request" if from_request else (source or "the step before it")
                raise PipelineError(
                    f"needs {need.describe()}, gets {have.describe()} from {origin}'s '{tensor}'",
                    node.name,
                    input_name,
                )
        return dict(signature.outputs)

    def switch(self, node: Node, current: Signature | None, scope: dict[str, Signature]) -> Signature:
        condition = node.condition
        assert condition is not None
        label = node.label()
        self.unrun(condition.tensor, current, scope, label, condition.tensor)
        tested = self.resolve(condition.tensor, current, scope)
        if tested is None:
            raise PipelineError("the condition's tensor is not there", step=label, tensor=condition.tensor)
        if tested.datatype not in ARITHMETIC:
            raise PipelineError(
                f"the condition needs a numeric tensor other than BF16, not {tested.datatype}", label, condition.tensor
            )
        then = self.node(node.children[0], current, dict(scope))
        if node.has_else:
            otherwise = self.node(node.children[1], current, dict(scope))
        elif current is None:
            raise PipelineError("a switch without 'else' passes its input through: put a step before it", label)
        else:
            otherwise = current
        self.same(label, then, otherwise, "'then' and 'else'")
        self.fixed(label, then, "merged across rows")
        return then

    def ensemble(self, node: Node, current: Signature | None, scope: dict[str, Signature]) -> Signature:
        label = node.label()
        # The members run side by side: none sees another's names; after, all have run on every row.
        branches = [dict(scope) for _ in node.children]
        responses = [self.node(child, current, b) for child, b in zip(node.children, branches, strict=True)]
        for b in branches:
            scope.update({k: v for k, v in b.items() if k not in scope})
        first = responses[0]
        for other in responses[1:]:
            if set(other) != set(first):
                missing = sorted(set(first) ^ set(other))[0]
                raise PipelineError("the members do not all answer this tensor", step=label, tensor=missing)
        combined: Signature = {}
        for name, spec in first.items():
            specs = [r[name] for r in responses]
            if node.combine == "concat":
                combined[name] = _concat(label, name, specs)
                continue
            for member in specs[1:]:
                if member.datatype != spec.datatype or member.shape != spec.shape:
                    raise PipelineError(
                        f"members answer {spec.describe()} and {member.describe()}: {node.combine} needs one type",
                        label,
                        name,
                    )
            if spec.variable:
                raise PipelineError(f"{node.combine} needs a fixed shape, not {spec.describe()}", label, name)
            if node.combine == "mean" and (spec.datatype not in FLOATS or spec.datatype not in ARITHMETIC):
                raise PipelineError(
                    f"mean needs a floating-point tensor other than BF16, not {spec.datatype}", label, name
                )
            if node.combine == "vote" and (spec.datatype not in ARITHMETIC or not spec.shape or spec.shape[-1] < 1):
                raise PipelineError("vote needs numeric scores other than BF16, with a class dimension", label, name)
            combined[name] = spec if node.combine == "mean" else Tensor("FP32", spec.shape)
        return combined

    def splitter(self, node: Node, current: Signature | None, scope: dict[str, Signature]) -> Signature:
        label = node.label()
        responses = [self.node(child, current, dict(scope)) for child in node.children]
        for other in responses[1:]:
            self.same(label, responses[0], other, "the branches")
        return responses[0]

    @staticmethod
    def same(label: str, a: Signature, b: Signature, what: str) -> None:
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                raise PipelineError(f"{what} must answer the same tensors", step=label, tensor=name)
            if a[name].datatype != b[name].datatype or a[name].shape != b[name].shape:
                raise PipelineError(
                    f"{what} answer {a[name].describe()} and {b[name].describe()}", step=label, tensor=name
                )

    @staticmethod
    def fixed(label: str, signature: Signature, why: str) -> None:
        for name, spec in signature.items():
            if spec.variable:
                raise PipelineError(f"a variable shape cannot be {why}: {spec.describe()}", label, name)


def _concat(label: str, name: str, specs: list[Tensor]) -> Tensor:
    first = specs[0]
    if not first.shape:
        raise PipelineError("concat needs a dimension to join along", label, name)
    last = 0
    for spec in specs:
        if (
            spec.datatype != first.datatype
            or len(spec.shape) != len(first.shape)
            or spec.shape[:-1] != first.shape[:-1]
        ):
            raise PipelineError(
                f"members answer {first.describe()} and {spec.describe()}: concat joins the last axis only", label, name
            )
        if spec.shape[-1] == -1:
            raise PipelineError("concat needs a fixed last dimension", label, name)
        last += spec.shape[-1]
    return Tensor(first.datatype, (*first.shape[:-1], last))


def check(spec: object, signatures: Callable[[str, int | None], ModelSignature | None]) -> Checked:
    """Parse and type-check `spec`: `signatures(model, version)` gives a step's model as the pipeline's
    tenant may see it (None: unknown or not visible). `PipelineError` names the step and tensor that
    do not connect."""
    root = parse(spec)
    checker = _Checker(signatures, {n.name for n in root.walk() if n.name})
    outputs = checker.node(root, None, {})
    if not checker.request:
        raise PipelineError("no step reads the request")
    splits = {}
    for node in root.walk():
        if node.kind == "splitter":
            splits[node.label()] = tuple(np.cumsum(node.weights).tolist())
    return Checked(root, dict(checker.request), outputs, checker.max_rows, tuple(checker.models), splits)


# -- the row arithmetic the executor applies -------------------------------------------------------


def combine(how: str, arrays: Sequence[np.ndarray], tensor: str = "") -> np.ndarray:
    """An ensemble's members' answers for one tensor (named `tensor`, for the error), combined.
    `CombineError` for answers that do not combine: `mean` and `vote` take one shape (`mean` one datatype
    too), `concat` one datatype and every dimension but the last."""
    first = arrays[0]
    for other in arrays[1:]:
        if how == "concat":
            fits = other.dtype == first.dtype and other.shape[:-1] == first.shape[:-1] and other.ndim == first.ndim
        else:
            fits = other.shape == first.shape and (how == "vote" or other.dtype == first.dtype)
        if not fits:
            words = f"members answer {_describe(first)} and {_describe(other)}: {how} cannot join them"
            raise CombineError(words, tensor)
    if how != "mean" and (first.ndim < 2 or first.shape[-1] == 0):
        raise CombineError(f"{how} needs a last dimension, members answer {_describe(first)}", tensor)
    if how == "mean":
        mean: np.ndarray = np.mean(np.stack(arrays), axis=0).astype(first.dtype, copy=False)
        return mean
    if how == "concat":
        return np.concatenate(arrays, axis=-1)
    # Each member's top class counted in place: memory is one answer's, whatever the number of classes (an
    # identity matrix of the classes, indexed by the top ones, would be classes² floats per call).
    votes = np.zeros(first.shape, dtype=np.float32)
    for a in arrays:
        top = np.expand_dims(np.argmax(a, axis=-1), -1)
        np.put_along_axis(votes, top, np.take_along_axis(votes, top, axis=-1) + 1, axis=-1)
    out: np.ndarray = votes / len(arrays)
    return out


def combine_answers(how: str, answers: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """An ensemble's members' answers combined tensor by tensor; `CombineError` when they do not all answer
    the same tensors, or for a tensor `combine` cannot join."""
    names = set(answers[0])
    for other in answers[1:]:
        if set(other) != names:
            missing = sorted(names ^ set(other))[0]
            raise CombineError("the members do not all answer this tensor", missing)
    return {name: combine(how, [a[name] for a in answers], name) for name in answers[0]}


def _describe(array: np.ndarray) -> str:
    """An answer's type as the check words one: its datatype and the shape after the batch dimension."""
    return f"{array.dtype.name} {list(array.shape[1:])}"


def choose_branch(weights: tuple[float, ...], u: float) -> int:
    """The splitter branch for a draw `u` in [0, 1)."""
    total = 0.0
    for i, w in enumerate(weights):
        total += w
        if u < total:
            return i
    return len(weights) - 1


def to_tensor(d: Mapping[str, object]) -> tuple[str, Tensor]:
    """A registry tensor spec ({name, datatype, shape[, max_shape]}) as the check takes it."""
    shape: tuple[int, ...] = tuple(d["shape"])  # type: ignore[arg-type]
    maxima = d.get("max_shape")
    return str(d["name"]), Tensor(str(d["datatype"]), shape, tuple(maxima) if maxima else None)  # type: ignore[arg-type]

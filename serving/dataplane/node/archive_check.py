"""Inspect a model archive before anything in it is loaded: zip, JSON and pickle opcodes are read as
data; nothing in the archive is imported, unpickled or evaluated.

`torch.export.load` (torch 2.13) runs code from the archive in several ways, so a `.pt2` archive is
accepted only in the plain form that `torch.export.save` writes for a program over tensors:

- weights and tensor constants stored as raw bytes (`use_pickle: false`); the pickled form is read
  with `torch.load(weights_only=False)`, custom objects with the TorchScript unpickler and opaque
  objects with `pickle.loads`;
- no legacy files (`data/weights/model.pt`, `data/constants/model.pt`, or the flat 2.7 layout with a
  top-level `version`), which go through `torch.load` with a `weights_only=False` fallback;
- no AOTInductor member (`data/aotinductor/`: a shared library that `load_pt2` loads), nor any other
  member that this check does not know;
- one program, `models/model.json`, whose symbolic expressions (`sympy.sympify`, which calls `eval`)
  use only sympy's and torch's shape functions, whose graph calls only `torch.ops` operators and the
  arithmetic builtins export emits for sizes, and whose names and tree specs contain only
  `[A-Za-z0-9_.]` (FX pastes them into the Python source it generates and `exec`s), and whose
  operators the operator policy allows (serving.dataplane.node.operator_check: no `aten::from_file`, no
  custom namespace the platform did not allow...);
- sample inputs (read by stock `torch.export.load` with a `weights_only=False` fallback; Ferry's
  loader never reads them) that reference only the globals of a plain tensor pickle.

Other zip archives are TorchScript: `torch.jit.load` reads their pickles with TorchScript's own
unpickler, which builds only tensors, containers, TorchScript types and TorchBind (C++) objects, and
compiles the code under `code/`, running a class's `__setstate__` as it unpickles one. So, unless
`check_operators` is false, that code is read first, as data (`check_torchscript_code`): it must be the
printable ASCII torch's printer writes and parse as Python (TorchScript's syntax is a subset), and it is
refused where it names a denied operator (operator_check.DENIED: `from_file`, `save`, `print`, `fork`...)
anywhere, in code, a string or a comment; where it calls an operator outside the allowed namespaces
(`ops.<namespace>.<name>`, by attribute or `getattr`); or where it or a pickle refers to a TorchBind class
outside operator_check.TORCHBIND_NAMESPACES. Nothing is compiled or run before this check. The complete
check of what the compiled code calls runs once it is compiled (operator_check.load_torchscript).
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import pickletools
import re
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from serving.dataplane.node import operator_check

MODEL = "model"  # the program name torch.export.save writes and torch.export.load returns
MAX_JSON_BYTES = 256 * 1024 * 1024
MAX_EXPR_CHARS = 20_000

SAFE_NAME = re.compile(r"[A-Za-z0-9_.]*")
PAYLOAD_NAME = re.compile(r"[A-Za-z0-9_]+")
SYMBOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NUMBER_TEXT = re.compile(r"[+-]?[0-9]*\.?[0-9]*(e[+-]?[0-9]+)?")

FIXED_MEMBERS = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
PROGRAM = f"models/{MODEL}.json"
WEIGHTS_CONFIG = f"data/weights/{MODEL}_weights_config.json"
CONSTANTS_CONFIG = f"data/constants/{MODEL}_constants_config.json"
SAMPLE_INPUTS = f"data/sample_inputs/{MODEL}.pt"

# Graph targets besides torch.ops.*: what torch.export serialises for size arithmetic (_SYM_OPS in
# torch/_export/serde/serialize.py) plus the builtins its verifier allows.
SIZE_TARGETS = frozenset(
    [
        f"_operator.{name}"
        for name in (
            "add",
            "and_",
            "eq",
            "floordiv",
            "ge",
            "getitem",
            "gt",
            "le",
            "lshift",
            "lt",
            "mod",
            "mul",
            "ne",
            "neg",
            "not_",
            "or_",
            "pos",
            "pow",
            "rshift",
            "sub",
            "truediv",
            "abs",
        )
    ]
    + ["math.ceil", "math.floor", "math.trunc"]
    + [
        f"torch.{name}"
        for name in (
            "_sym_sqrt",
            "sym_float",
            "sym_int",
            "sym_ite",
            "sym_max",
            "sym_min",
            "sym_not",
            "sym_sqrt",
            "sym_sum",
        )
    ]
)

# Functions a serialised shape expression (sympy.srepr) may call: sympy's own and torch's
# (torch.utils._sympy.functions, the table in GraphModuleDeserializer.deserialize).
EXPR_FUNCTIONS = frozenset(
    (
        "Symbol",
        "Dummy",
        "Integer",
        "Rational",
        "Float",
        "Add",
        "Mul",
        "Pow",
        "Mod",
        "Max",
        "Min",
        "Abs",
        "Equality",
        "Unequality",
        "LessThan",
        "StrictLessThan",
        "GreaterThan",
        "StrictGreaterThan",
        "Eq",
        "Ne",
        "Lt",
        "Le",
        "Gt",
        "Ge",
        "And",
        "Or",
        "Not",
        "Xor",
        "Piecewise",
        "ExprCondPair",
        "floor",
        "ceiling",
        "sqrt",
        "Tuple",
        "FloorDiv",
        "ModularIndexing",
        "Where",
        "PythonMod",
        "CleanDiv",
        "CeilToInt",
        "FloorToInt",
        "CeilDiv",
        "LShift",
        "RShift",
        "PowByNatural",
        "FloatPow",
        "FloatTrueDiv",
        "IntTrueDiv",
        "IsNonOverlappingAndDenseIndicator",
        "TruncToFloat",
        "TruncToInt",
        "RoundToInt",
        "RoundDecimal",
        "ToFloat",
        "Identity",
    )
)
EXPR_KEYWORDS = frozenset(
    (
        "positive",
        "negative",
        "nonnegative",
        "nonpositive",
        "integer",
        "real",
        "finite",
        "infinite",
        "zero",
        "nonzero",
        "even",
        "odd",
        "rational",
        "commutative",
        "precision",
    )
)
EXPR_NODES = (
    ast.Expression,
    ast.Call,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.keyword,
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.Compare,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
    ast.USub,
    ast.UAdd,
    ast.Not,
    ast.Invert,
    ast.BitAnd,
    ast.BitOr,
    ast.And,
    ast.Or,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
)

# Keys whose string values torch keeps as data (debug metadata, string arguments, version text) or
# that Ferry's loader never runs (guards_code: module(check_guards=False), no example inputs).
FREE_TEXT_KEYS = frozenset(("metadata", "as_string", "as_strings", "torch_version", "guards_code"))

# Globals of a plain tensor pickle (what torch.save writes for a tuple of tensors).
TENSOR_PICKLE_GLOBALS = frozenset(
    (
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        ("collections", "OrderedDict"),
        ("torch", "device"),
        ("torch", "Size"),
    )
)
STORAGE_CLASS = re.compile(r"[A-Za-z0-9]*Storage")
REFUSED_PICKLE_OPS = frozenset(("STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"))


class ArchiveRefused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_archive(
    source: Path | BinaryIO, *, check_operators: bool = True, allowed_namespaces: Iterable[str] | None = None
) -> str:
    """Check a zip archive as data; return "torch_export" for a .pt2 package, "zip" for any other zip
    (TorchScript). Raise ArchiveRefused with the reason for an archive that would run code on load, or
    (unless `check_operators` is false) whose program calls an operator the policy refuses;
    `allowed_namespaces`: the admin's extra operator namespaces (default: the environment's setting)."""
    try:
        with zipfile.ZipFile(source) as zf:
            infos = [info for info in zf.infolist() if not info.is_dir()]
            names = [info.filename for info in infos]
            if "version" in names:
                raise ArchiveRefused(
                    "legacy torch.export layout (a top-level version member): torch.export.load reads its "
                    "serialized_*.pt with torch.load and falls back to weights_only=False; re-save with "
                    "torch.export.save"
                )
            root = _check_zip_names(names)
            sizes = {info.filename[len(root) :]: info.file_size for info in infos}

            def read(name: str) -> bytes:
                if sizes.get(name, 0) > MAX_JSON_BYTES:
                    raise ArchiveRefused(f"member {name} is too large to inspect ({sizes[name]} bytes)")
                return zf.read(root + name)

            if "archive_format" not in sizes or read("archive_format") != b"pt2":
                if check_operators:
                    check_torchscript_records(list(sizes), read, allowed_namespaces=allowed_namespaces)
                return "zip"
            check_pt2_records(list(sizes), read, check_operators=check_operators, allowed_namespaces=allowed_namespaces)
            return "torch_export"
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        EOFError,
        OSError,
        ValueError,
        KeyError,
        NotImplementedError,  # a compression method Python's zipfile cannot read
    ) as exc:
        raise ArchiveRefused(f"unreadable archive: {type(exc).__name__}: {exc}") from None


def _check_zip_names(names: list[str]) -> str:
    """The archive's one top folder (torch's reader takes it from the first member)."""
    if not names:
        raise ArchiveRefused("empty archive")
    root = names[0].split("/", 1)[0] + "/"
    seen: set[str] = set()
    for name in names:
        # torch's reader (miniz) looks names up case-insensitively, Python's zipfile exactly: two
        # members that differ only in case could show each reader a different file.
        folded = name.lower()
        if folded in seen:
            raise ArchiveRefused(f"duplicate member {name!r}")
        seen.add(folded)
        if not name.startswith(root) or name == root:
            raise ArchiveRefused(f"member {name!r} is outside the archive's folder {root!r}")
    return root


def check_pt2_records(
    names: list[str],
    read: Callable[[str], bytes],
    *,
    check_operators: bool = True,
    allowed_namespaces: Iterable[str] | None = None,
) -> None:
    """The .pt2 checks, on member names relative to the archive folder and a reader of them: the
    registration check passes Python's zipfile, the loader passes torch's own archive reader."""
    present = set(names)
    version = read("archive_version").decode(errors="replace").strip() if "archive_version" in present else None
    if version != "0":
        raise ArchiveRefused(f"pt2 archive version {version!r} is not 0")
    programs = sorted(n for n in present if n.startswith("models/"))
    if programs != [PROGRAM]:
        raise ArchiveRefused(f"expected one program {PROGRAM}, found {programs or 'none'}")
    for legacy in (f"data/weights/{MODEL}.pt", f"data/constants/{MODEL}.pt"):
        if legacy in present:
            raise ArchiveRefused(
                f"{legacy} is a legacy pickled payload (read with torch.load); re-save with torch.export.save"
            )
    for required in (WEIGHTS_CONFIG, CONSTANTS_CONFIG):
        if required not in present:
            raise ArchiveRefused(f"{required} is missing")
    allowed = set(FIXED_MEMBERS) | {PROGRAM, WEIGHTS_CONFIG, CONSTANTS_CONFIG, SAMPLE_INPUTS}
    allowed |= _payload_members(read(WEIGHTS_CONFIG), WEIGHTS_CONFIG, "weight")
    allowed |= _payload_members(read(CONSTANTS_CONFIG), CONSTANTS_CONFIG, "constant")
    for name in sorted(present - allowed):
        if name.startswith("extra/"):
            continue  # read as text into extra_files; Ferry's loader does not read them
        if name.startswith("data/aotinductor/"):
            raise ArchiveRefused(f"{name}: AOTInductor members (compiled shared libraries) are not accepted")
        raise ArchiveRefused(f"unexpected member {name}")
    program = _json(read(PROGRAM), PROGRAM)
    check_program(program)
    if check_operators:
        refused = operator_check.refused(operator_check.export_operators(program), allowed_namespaces)
        if refused:
            raise ArchiveRefused(operator_check.OperatorRefused(refused).reason)
    if SAMPLE_INPUTS in present:
        _check_tensor_pickle_archive(read(SAMPLE_INPUTS), SAMPLE_INPUTS)


# --- TorchScript: the code and pickles, read before anything is compiled ------------------------------------

# What torch's printer (python_print.cpp) writes: printable ASCII and newlines; string literals that hold
# anything else go to constants.pkl. Refusing the rest leaves no character (a lone \r, \f, \v, a Unicode line
# break) that Python's parser and TorchScript's lexer could read differently.
CODE_TEXT = re.compile(rb"[\x20-\x7e\n]*")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
TORCHSCRIPT_PICKLE_OPS = REFUSED_PICKLE_OPS  # torch's pickler writes GLOBAL, never these


def check_torchscript_records(
    names: list[str], read: Callable[[str], bytes], *, allowed_namespaces: Iterable[str] | None = None
) -> None:
    """The TorchScript checks, on member names relative to the archive folder and a reader of them: every
    `.py` member (torch compiles `code/**.py`; its reader matches names without regard to case) is checked
    as code, every pickle for the TorchBind classes it refers to. Raises ArchiveRefused naming the refused
    operators and classes."""
    extra = (
        operator_check.configured_namespaces()
        if allowed_namespaces is None
        else operator_check.parse_namespaces(allowed_namespaces)
    )
    found: set[str] = set()
    for name in sorted(names):
        lower = name.lower()
        if lower.endswith(".py"):
            found |= check_torchscript_code(read(name), name, extra)
        elif lower.endswith("pkl"):  # data.pkl, constants.pkl, the code's .debug_pkl
            found |= _torchscript_pickle_classes(read(name), name, extra)
    if found:
        raise ArchiveRefused(operator_check.OperatorRefused(found).reason)


def check_torchscript_code(raw: bytes, what: str, extra_namespaces: Iterable[str] = ()) -> set[str]:
    """The operators and TorchBind classes a TorchScript code file names that the policy refuses: every
    denied operator's name (operator_check.DENIED_NAMES) that appears as a word anywhere in the text (a
    string escape's backslash dropped), whether or not it is a call; every `ops.<namespace>.<name>` and
    `torch.<name>` (attributes, or `getattr` with a literal name: how TorchScript resolves builtins) the
    allow-list refuses; and every `torch.classes.<namespace>` outside TORCHBIND_NAMESPACES and the extra
    namespaces. ArchiveRefused where the text is not what torch's printer writes."""
    extra = frozenset(extra_namespaces)
    if not CODE_TEXT.fullmatch(raw):
        raise ArchiveRefused(f"{what}: code holds bytes outside printable ASCII (torch's printer writes none)")
    text = raw.decode("ascii")
    try:
        tree = ast.parse(text, filename=what)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ArchiveRefused(f"{what}: code does not parse as TorchScript's printed code") from None
    words = set(WORD.findall(text.replace("\\", "")))
    found = {operator_check.DENIED_NAMES[word] for word in words if word in operator_check.DENIED_NAMES}
    for chain in _chains(tree):
        found |= _chain_refusals(chain, extra)
    return found


def _chain_base(node: ast.AST) -> ast.AST | None:
    """What `node` extends by one name: an attribute's object, or getattr's and hasattr's first argument
    where the second is a literal name."""
    if isinstance(node, ast.Attribute):
        return node.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[0]
    return None


def _chains(tree: ast.AST) -> list[list[str]]:
    """Every longest dotted name in the code (`ops.aten.add`, `getattr(torch, "relu")` as torch.relu), each
    from a plain name at its root."""
    nodes = list(ast.walk(tree))
    extended = {id(base) for base in map(_chain_base, nodes) if base is not None}
    chains = []
    for node in nodes:
        if id(node) in extended or _chain_base(node) is None:
            continue
        parts: list[str] = []
        current: ast.AST | None = node
        while current is not None and not isinstance(current, ast.Name):
            if isinstance(current, ast.Attribute):
                parts.append(current.attr)
            else:
                parts.append(current.args[1].value)  # type: ignore[attr-defined]
            current = _chain_base(current)
        if isinstance(current, ast.Name):
            chains.append([current.id, *reversed(parts)])
    return chains


def _chain_refusals(chain: list[str], extra: frozenset[str]) -> set[str]:
    """What the policy refuses in one dotted name: an operator (`ops.<namespace>.<name>`, `torch.<name>`:
    aten's), a namespace of operators on its own, a TorchBind class."""
    found = _torchbind_refusals(chain, extra)
    if chain[:2] == ["torch", "ops"]:
        chain = chain[1:]
    if chain[0] == "ops" and len(chain) > 2:
        operator = f"{chain[1]}::{chain[2]}"
        if not operator_check.allowed(operator, extra):
            found.add(operator)
    elif chain[0] == "ops" and len(chain) == 2:
        if chain[1] not in operator_check.ALLOWED_NAMESPACES | {operator_check.HIGHER_ORDER} | extra:
            found.add(f"{chain[1]}::*")
    elif chain[0] == "torch" and "classes" not in chain:
        found |= {f"aten::{name}" for name in chain[1:] if not operator_check.allowed(f"aten::{name}", extra)}
    return found


def _torchbind_refusals(chain: list[str], extra: frozenset[str]) -> set[str]:
    """`torch.classes.<namespace>...` (in code, and in pickles as `__torch__.torch.classes...`) outside
    TORCHBIND_NAMESPACES and the extra namespaces."""
    found = set()
    for i in range(len(chain) - 2):
        if chain[i : i + 2] == ["torch", "classes"] and chain[i + 2] not in operator_check.TORCHBIND_NAMESPACES | extra:
            found.add(".".join(chain[i:]))
    return found


def _torchscript_pickle_classes(raw: bytes, what: str, extra: frozenset[str]) -> set[str]:
    """The TorchBind classes a TorchScript pickle builds objects of that the policy refuses (their C++
    `__setstate__` runs while the archive loads)."""
    found: set[str] = set()
    try:
        for op, arg, _pos in pickletools.genops(raw):
            if op.name in TORCHSCRIPT_PICKLE_OPS:
                raise ArchiveRefused(f"{what}: pickle opcode {op.name} is not accepted (torch writes GLOBAL)")
            if op.name == "GLOBAL":
                module, _, name = str(arg).partition(" ")
                found |= _torchbind_refusals(f"{module}.{name}".split("."), extra)
    except ValueError as exc:
        raise ArchiveRefused(f"{what}: malformed pickle: {exc}") from None
    return found


def _json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArchiveRefused(f"{what} is not JSON: {exc}") from None


def _payload_members(raw: bytes, config_name: str, kind: str) -> set[str]:
    """The payload files a weights or constants config names; refuses any that would be unpickled."""
    folder = config_name.rsplit("/", 1)[0] + "/"
    doc = _json(raw, config_name)
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        raise ArchiveRefused(f"{config_name} has no 'config' table")
    members = set()
    for fqn, meta in config.items():
        _check_name(fqn, f"{kind} name")
        if not isinstance(meta, dict):
            raise ArchiveRefused(f"{kind} {fqn!r}: malformed entry")
        path_name = meta.get("path_name")
        if not isinstance(path_name, str) or not PAYLOAD_NAME.fullmatch(path_name):
            raise ArchiveRefused(f"{kind} {fqn!r}: bad path_name {path_name!r}")
        if kind == "constant" and not path_name.startswith("tensor_"):
            raise ArchiveRefused(
                f"constant {fqn!r} ({path_name}) is not a tensor: custom and opaque objects are unpickled on load"
            )
        if meta.get("use_pickle") is not False:
            raise ArchiveRefused(
                f"{kind} {fqn!r} is stored pickled (use_pickle), which torch.export.load reads "
                "with torch.load(weights_only=False)"
            )
        if not isinstance(meta.get("tensor_meta"), dict):
            raise ArchiveRefused(f"{kind} {fqn!r} has no tensor_meta")
        members.add(folder + path_name)
    return members


def check_program(doc: Any) -> None:
    """The serialised ExportedProgram (models/model.json): every string torch turns into code."""
    _walk(doc, "")


def _walk(value: Any, key: str) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _check_name(k, "key")
            if k in FREE_TEXT_KEYS:
                continue
            if k in ("target", "as_operator"):
                _check_target(v)
            elif k == "expr_str":
                _check_expr(v)
            elif k in ("in_spec", "out_spec"):
                _check_treespec(v, k)
            else:
                _walk(v, k)
    elif isinstance(value, list):
        for item in value:
            _walk(item, key)
    elif isinstance(value, str):
        _check_name(value, key or "value")


def _check_name(value: object, what: str) -> None:
    if not isinstance(value, str) or not SAFE_NAME.fullmatch(value):
        raise ArchiveRefused(f"{what} {value!r} has characters outside [A-Za-z0-9_.] (names reach generated code)")


def _check_target(target: object) -> None:
    if not isinstance(target, str):
        raise ArchiveRefused(f"graph target {target!r} is not a string")
    if target in SIZE_TARGETS:
        return
    parts = target.split(".")
    if (
        len(parts) >= 4
        and parts[:2] == ["torch", "ops"]
        and all(p.isidentifier() and not p.startswith("__") for p in parts)
    ):
        return
    raise ArchiveRefused(
        f"graph calls {target!r}, which is not an operator (accepted: torch.ops.*, and the "
        "size arithmetic torch.export emits)"
    )


def _check_expr(expr: object) -> None:
    if not isinstance(expr, str) or len(expr) > MAX_EXPR_CHARS:
        raise ArchiveRefused("symbolic expression is not a string or is too long")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError):
        raise ArchiveRefused(f"symbolic expression {expr[:80]!r} does not parse") from None
    allowed_strings: set[int] = set()  # ids of the string constants seen as a symbol's name or a number's text
    for node in ast.walk(tree):
        if not isinstance(node, EXPR_NODES):
            raise ArchiveRefused(
                f"symbolic expression {expr[:80]!r}: {type(node).__name__} is not accepted "
                "(sympy evaluates these strings with eval)"
            )
        if isinstance(node, ast.Name) and (node.id.startswith("_") or hasattr(builtins, node.id)):
            raise ArchiveRefused(f"symbolic expression {expr[:80]!r} names {node.id!r}")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in EXPR_FUNCTIONS:
                raise ArchiveRefused(f"symbolic expression {expr[:80]!r} calls {ast.unparse(node.func)!r}")
            for kw in node.keywords:
                if kw.arg not in EXPR_KEYWORDS or not isinstance(kw.value, ast.Constant):
                    raise ArchiveRefused(f"symbolic expression {expr[:80]!r}: keyword {kw.arg!r}")
            first = node.args[0] if node.args else None
            if (
                isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and (
                    (node.func.id in ("Symbol", "Dummy") and SYMBOL_NAME.fullmatch(first.value))
                    or (node.func.id in ("Float", "Integer") and NUMBER_TEXT.fullmatch(first.value))
                )
            ):
                allowed_strings.add(id(first))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and not (
            type(node.value) in (int, float, bool) or (isinstance(node.value, str) and id(node) in allowed_strings)
        ):
            raise ArchiveRefused(f"symbolic expression {expr[:80]!r}: constant {node.value!r:.40}")


def _check_treespec(spec: object, what: str) -> None:
    """A pytree spec is JSON text whose dict contexts are JSON text again; FX writes the keys into
    the generated forward (`{'key': arg}`), so every string in it must be a plain name."""
    if not isinstance(spec, str):
        raise ArchiveRefused(f"{what} is not a string")
    _walk_spec(_json(spec.encode(), what), what)


def _walk_spec(value: Any, what: str) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _check_name(k, what)
            if k == "context" and isinstance(v, str):
                _walk_spec(_json(v.encode(), what), what)
            else:
                _walk_spec(v, what)
    elif isinstance(value, list):
        for item in value:
            _walk_spec(item, what)
    elif isinstance(value, str):
        _check_name(value, what)


def _check_tensor_pickle_archive(raw: bytes, what: str) -> None:
    """A torch.save archive must hold a plain tensor pickle: stock torch retries a pickle that its
    weights_only unpickler refuses with weights_only=False, so anything else is refused here."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as inner:
            pickles = [n for n in inner.namelist() if n.endswith(".pkl")]
            if len(pickles) != 1 or not pickles[0].endswith("/data.pkl"):
                raise ArchiveRefused(f"{what}: expected one data.pkl, found {pickles}")
            data = inner.read(pickles[0])
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise ArchiveRefused(f"{what} is not a torch.save archive: {exc}") from None
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name in REFUSED_PICKLE_OPS:
                raise ArchiveRefused(f"{what}: pickle opcode {op.name} is not accepted")
            if op.name == "GLOBAL":
                module, _, name = str(arg).partition(" ")
                if (module, name) not in TENSOR_PICKLE_GLOBALS and not (
                    module == "torch" and STORAGE_CLASS.fullmatch(name)
                ):
                    raise ArchiveRefused(f"{what} references {module}.{name}, which a tensor pickle does not")
    except ValueError as exc:
        raise ArchiveRefused(f"{what}: malformed pickle: {exc}") from None

"""aio/_C.pyi against the built aio._C: the same public names (functions,
classes, their methods and properties), the same argument names in the same
order, the same arguments with defaults, and the same kind of return value.

The stub is parsed with ast; the module is introspected with dir()/vars() and
the signature line pybind11 writes at the top of each docstring, e.g.
``submit(self: aio._C.Handle, op: object, ...) -> aio._C.Request``."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import aio._C

STUB = Path(aio.__file__).resolve().parent / "_C.pyi"
MODULE = "aio._C"


@dataclass
class Sig:
    """Argument names (without self), which of them have a default, and the
    return type's base name (``dict`` for ``dict[str, Any]``)."""

    args: list[str]
    defaults: set[str]
    returns: str


def _base_type(text: str) -> str:
    text = text.strip().removeprefix(MODULE + ".")
    return re.split(r"[\[|]", text, maxsplit=1)[0].strip()


def _split_args(text: str) -> list[str]:
    """Comma-separated parts of ``text`` at bracket depth 0."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts]


def runtime_sig(obj: object, name: str) -> Sig:
    """The signature pybind11 wrote into the first line of obj's docstring."""
    line = (getattr(obj, "__doc__", None) or "").split("\n", 1)[0]
    m = re.fullmatch(rf"{re.escape(name)}\((.*)\) -> (.+)", line)
    assert m, f"{name}: no pybind11 signature line in its docstring: {line!r} (overloaded?)"
    args, defaults = [], set()
    for part in _split_args(m.group(1)):
        arg = part.split(":", 1)[0].strip()
        if arg == "self":
            continue
        args.append(arg)
        if "=" in part:
            defaults.add(arg)
    return Sig(args, defaults, _base_type(m.group(2)))


def stub_sig(fn: ast.FunctionDef) -> Sig:
    a = fn.args
    positional = a.posonlyargs + a.args
    names = [x.arg for x in positional + a.kwonlyargs]
    with_default = [x.arg for x in positional[len(positional) - len(a.defaults) :]]
    with_default += [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
    if names and names[0] == "self":
        names = names[1:]
    returns = _base_type(ast.unparse(fn.returns)) if fn.returns else "?"
    return Sig(names, set(with_default), returns)


@dataclass
class StubClass:
    methods: dict[str, ast.FunctionDef]
    properties: dict[str, ast.FunctionDef]


def parse_stub(text: str) -> tuple[dict[str, ast.FunctionDef], dict[str, StubClass]]:
    """(module functions, classes) declared in the stub."""
    functions: dict[str, ast.FunctionDef] = {}
    classes: dict[str, StubClass] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            cls = StubClass({}, {})
            for item in node.body:
                if not isinstance(item, ast.FunctionDef):
                    continue
                is_prop = any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list)
                (cls.properties if is_prop else cls.methods)[item.name] = item
            classes[node.name] = cls
    return functions, classes


def _public(name: str) -> bool:
    return not name.startswith("_")


def _compare_sig(where: str, runtime: Sig, stub: Sig) -> list[str]:
    problems = []
    if runtime.args != stub.args:
        problems.append(f"{where}: arguments {stub.args} in the stub, {runtime.args} in the module")
    if runtime.defaults != stub.defaults:
        problems.append(
            f"{where}: defaults for {sorted(stub.defaults)} in the stub, "
            f"{sorted(runtime.defaults)} in the module"
        )
    # pybind11 writes "dict" for py::dict and "object" where it cannot tell.
    if runtime.returns not in (stub.returns, "object"):
        problems.append(f"{where}: returns {stub.returns} in the stub, {runtime.returns} in the module")
    return problems


def _compare_names(where: str, kind: str, runtime: set[str], stub: set[str]) -> list[str]:
    problems = [f"{where}: {kind} {n} is in the module but not in the stub" for n in sorted(runtime - stub)]
    problems += [f"{where}: {kind} {n} is in the stub but not in the module" for n in sorted(stub - runtime)]
    return problems


def _compare_class(name: str, cls: type, stub: StubClass) -> list[str]:
    own = {n: v for n, v in vars(cls).items() if _public(n)}
    props = {n for n, v in own.items() if isinstance(v, property)}
    methods = set(own) - props
    problems = _compare_names(name, "property", props, set(stub.properties))
    problems += _compare_names(name, "method", methods, {n for n in stub.methods if _public(n)})
    for m in sorted(methods & set(stub.methods)):
        where = f"{name}.{m}"
        problems += _compare_sig(where, runtime_sig(own[m], m), stub_sig(stub.methods[m]))
    for p in sorted(props & set(stub.properties)):
        fget = own[p].fget
        runtime = runtime_sig(fget, "") if fget.__doc__ and fget.__doc__.startswith("(") else None
        stub_ret = stub_sig(stub.properties[p]).returns
        if runtime and runtime.returns not in (stub_ret, "object"):
            problems.append(f"{name}.{p}: returns {stub_ret} in the stub, {runtime.returns} in the module")
    # A constructor bound by pybind11 (py::init) is documented like a method;
    # a class without one cannot be created from Python.
    init = vars(cls).get("__init__")
    if init is not None and (init.__doc__ or "").startswith("__init__("):
        if "__init__" not in stub.methods:
            problems.append(f"{name}.__init__ is in the module but not in the stub")
        else:
            sig = runtime_sig(init, "__init__")
            problems += _compare_sig(f"{name}.__init__", sig, stub_sig(stub.methods["__init__"]))
    elif "__init__" in stub.methods:
        problems.append(f"{name}.__init__ is in the stub but the module binds no constructor")
    return problems


def stub_problems(stub_text: str, module: object) -> list[str]:
    """Every difference between the stub text and the module's public names and signatures."""
    functions, classes = parse_stub(stub_text)
    public = {n: getattr(module, n) for n in dir(module) if _public(n)}
    rt_classes = {n for n, v in public.items() if isinstance(v, type)}
    rt_functions = set(public) - rt_classes
    problems = _compare_names(MODULE, "class", rt_classes, set(classes))
    problems += _compare_names(MODULE, "function", rt_functions, set(functions))
    for n in sorted(rt_functions & set(functions)):
        problems += _compare_sig(n, runtime_sig(public[n], n), stub_sig(functions[n]))
    for n in sorted(rt_classes & set(classes)):
        problems += _compare_class(n, public[n], classes[n])
    return problems


def test_stub_matches_the_built_module():
    assert stub_problems(STUB.read_text(), aio._C) == []


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ("def page_size() -> int: ...\n", "", "function page_size is in the module but not in the stub"),
        ("def fault_hits(self) -> int: ...", "", "Handle: method fault_hits is in the module"),
        (
            "def page_size() -> int: ...",
            "def page_size() -> int: ...\ndef gone() -> None: ...",
            "function gone is in the stub but not in the module",
        ),
        ("nth: int, count: int", "count: int, nth: int", "Handle.inject_fault: arguments"),
        (
            "lock: bool = True) -> None: ...\n    def __buffer__",
            "lock: bool) -> None: ...\n    def __buffer__",
            "defaults",
        ),
        ("def alignment(self) -> int", "def alignment(self) -> str", "Handle.alignment: returns str"),
        ("def engine(self) -> str", "def engine(self) -> int", "Handle.engine: returns int"),
        (
            "    @property\n    def is_write",
            "    def is_write",
            "Request: property is_write is in the module",
        ),
        (
            "def result(self) -> int: ...",
            "def result(self) -> int: ...\n    def __init__(self) -> None: ...",
            "Request.__init__ is in the stub",
        ),
    ],
)
def test_a_stub_that_differs_is_caught(old, new, expected):
    """The comparison is not vacuous: each kind of drift is reported."""
    text = STUB.read_text()
    assert old in text, old
    problems = stub_problems(text.replace(old, new, 1), aio._C)
    assert any(expected in p for p in problems), problems

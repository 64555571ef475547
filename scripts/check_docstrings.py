#!/usr/bin/env python3
"""List public Python names without a docstring; exit 1 if there is any.

Usage: check_docstrings.py [PATH ...]   (files or folders; default: aio/)

Public means: a module, a module-level function or class, or a method or
property of a public class, whose name does not start with ``_``. Names in
modules whose file name starts with ``_`` count too: they are read by
contributors. Nested functions, ``@x.setter``/``@x.deleter`` halves of a
property and ``@overload`` stubs are skipped; ``.pyi`` stubs are not read.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

_Def = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _skipped(node: ast.AST) -> bool:
    """A setter/deleter half of a property, or an @overload stub."""
    for d in getattr(node, "decorator_list", []):
        if isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter"):
            return True
        name = d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")
        if name == "overload":
            return True
    return False


def undocumented(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, qualified name) of each public name in `tree` that has no docstring."""
    if ast.get_docstring(tree) is None:
        yield 1, "<module>"
    for node in tree.body:
        if not isinstance(node, _Def) or node.name.startswith("_") or _skipped(node):
            continue
        if ast.get_docstring(node) is None:
            yield node.lineno, node.name
        if not isinstance(node, ast.ClassDef):
            continue
        for member in node.body:
            if not isinstance(member, _Def) or member.name.startswith("_") or _skipped(member):
                continue
            if ast.get_docstring(member) is None:
                yield member.lineno, f"{node.name}.{member.name}"


def python_files(paths: list[str]) -> Iterator[Path]:
    """The .py files named in `paths`, folders walked recursively, in sorted order."""
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(q for q in p.rglob("*.py") if q.is_file())
        elif p.suffix == ".py":
            yield p
        else:
            raise SystemExit(f"check_docstrings: not a .py file or a folder: {p}")


def main(argv: list[str]) -> int:
    """Print one ``path:line: name`` per undocumented public name; 1 if any, else 0."""
    missing = 0
    for path in python_files(argv or ["aio"]):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in undocumented(tree):
            print(f"{path}:{line}: {name} has no docstring")
            missing += 1
    if missing:
        print(f"{missing} public name(s) without a docstring", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

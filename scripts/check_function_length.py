#!/usr/bin/env python3
"""Fail when a function is too long to read at once.

Python files (``*.py``) are measured with ``ast``: a function spans from its
``def`` line to its last line (nested functions are measured on their own as
well as inside their parent). C++ files (``*.cpp``, ``*.h``) are scanned with
a brace matcher: a function body spans from the line of the ``{`` that opens
it to the line of the matching ``}``; lambdas and blocks inside a function
count towards that function.

    python3 scripts/check_function_length.py [--max N] [PATH ...]

PATHs are files or folders (searched recursively); the default is ``aio`` and
``csrc``. Prints one line per function over the limit and exits 1 if any is.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

DEFAULT_MAX = 80
DEFAULT_PATHS = ("aio", "csrc")
CPP_SUFFIXES = (".cpp", ".cc", ".h", ".hpp")

# Scopes whose braces hold declarations rather than statements.
_SCOPE_HEAD = re.compile(r"^(?:template\s*<.*>\s*)?(namespace|class|struct|union|enum|extern)\b", re.S)
_OPERATOR = re.compile(r"\boperator\s*(?:\(\)|[^\s(]+)")


def python_functions(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, first line, line count) of every function in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                end = child.end_lineno or child.lineno
                found.append((name, child.lineno, end - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _strip_cpp(text: str) -> str:
    """``text`` with comments, string/char literals and preprocessor lines
    blanked out; newlines are kept so line numbers stay right."""
    out: list[str] = []
    i, n = 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c == "#":
            # Preprocessor line (with backslash continuations).
            while i < n and not (text[i] == "\n" and text[i - 1] != "\\"):
                out.append("\n" if text[i] == "\n" else " ")
                i += 1
            continue
        if text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join("\n" if ch == "\n" else " " for ch in text[i:j]))
            i = j
            continue
        raw = re.match(r'R"([^(\s]*)\(', text[i:])
        if raw:
            close = ")" + raw.group(1) + '"'
            j = text.find(close, i + raw.end())
            j = n if j < 0 else j + len(close)
            out.append('""' + "".join("\n" for ch in text[i:j] if ch == "\n"))
            i = j
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
            continue
        if not c.isspace():
            at_line_start = False
        elif c == "\n":
            at_line_start = True
        out.append(c)
        i += 1
    return "".join(out)


def _function_name(head: str) -> str | None:
    """The function name if the text before a ``{`` (at declaration scope)
    is a function header, else None (class, namespace, initializer...)."""
    head = " ".join(head.split())
    if not head or _SCOPE_HEAD.match(head):
        return None
    head = _OPERATOR.sub("operator", head)
    paren = head.find("(")
    if paren < 0 or ")" not in head:
        return None
    if "=" in head[:paren]:
        return None  # an initializer (lambda, braced value), not a function
    m = re.search(r"([~\w:]+)\s*$", head[:paren])
    return m.group(1) if m else None


def cpp_functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, line of the opening brace, line count) of every function body."""
    text = _strip_cpp(path.read_text(encoding="utf-8"))
    found: list[tuple[str, int, int]] = []
    # Each open brace: (kind, name, line); kind is "scope", "function" or "other".
    stack: list[tuple[str, str | None, int]] = []
    head_start = 0
    line = 1
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        in_function = any(kind != "scope" for kind, _, _ in stack)
        if c == "{":
            if in_function:
                stack.append(("other", None, line))
                continue
            head = text[head_start:i]
            name = _function_name(head)
            if name:
                stack.append(("function", name, line))
            elif _SCOPE_HEAD.match(" ".join(head.split())):
                stack.append(("scope", None, line))
            else:
                stack.append(("other", None, line))
            head_start = i + 1
        elif c == "}":
            if not stack:
                continue
            kind, name, start = stack.pop()
            if kind == "function" and name:
                found.append((name, start, line - start + 1))
            if not any(k != "scope" for k, _, _ in stack):
                head_start = i + 1
        elif c == ";" and not in_function:
            head_start = i + 1
        elif c == ":" and not in_function:
            # Access specifiers ("public:") end a header; "::" and the ':' of
            # a constructor's initializer list do not.
            before = text[head_start:i].strip()
            if before in ("public", "private", "protected"):
                head_start = i + 1
    return found


def iter_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.suffix in (".py", *CPP_SUFFIXES)))
        elif p.is_file():
            files.append(p)
        else:
            raise SystemExit(f"check_function_length: no such file or folder: {p}")
    return files


def long_functions(paths: list[str], limit: int) -> list[str]:
    """One line per function over ``limit`` lines under ``paths``."""
    problems: list[str] = []
    for f in iter_files(paths):
        funcs = python_functions(f) if f.suffix == ".py" else cpp_functions(f)
        for name, first, count in funcs:
            if count > limit:
                problems.append(f"{f}:{first}: {name} is {count} lines (limit {limit})")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max", type=int, default=DEFAULT_MAX, help="most lines a function may have")
    ap.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS))
    args = ap.parse_args(argv)
    problems = long_functions(args.paths, args.max)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} function(s) over {args.max} lines", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

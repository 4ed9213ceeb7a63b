#!/usr/bin/env python3
"""Functions longer than N lines (default 80) in the tracked C/C++ and Python sources, longest
first, and whether each argues its length in a comment (issue 30: none over ~80 lines without a
reason stated in it).

    python3 tools/dev/function_lengths.py [N] [--unargued]

A function argues its length with a comment that starts "Long:" (C++ `// Long: ...`, Python
`# Long: ...`) on the lines just above it or in its body. Python lengths leave out the docstring.
C++ functions are found by a brace scan (comments, strings and preprocessor lines dropped): a
`{` at namespace or class scope after a header with a parenthesis opens a function.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTROL = re.compile(r"\b(if|for|while|switch|catch|do|else)\s*(\(|$)")
ARGUED = re.compile(r"^\s*(//|#)\s*Long:")


def strip_cpp(src):
    """The source with comments, literals and preprocessor lines blanked (newlines kept)."""
    keep_lines = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731
    out = re.sub(r'R"(\w*)\((.|\n)*?\)\1"', keep_lines, src)
    out = re.sub(r"//[^\n]*", "", out)
    out = re.sub(r"/\*(.|\n)*?\*/", keep_lines, out)
    out = re.sub(r'"(\\.|[^"\\\n])*"', '""', out)
    out = re.sub(r"'(\\.|[^'\\\n])*'", "''", out)
    return re.sub(r"^[ \t]*#[^\n]*", "", out, flags=re.MULTILINE)


def cpp_functions(text):
    """(first line of its header, first and last line of its body, header) of every function at
    namespace or class scope."""
    stack, header, line, header_line = [], "", 1, 1
    for ch in strip_cpp(text):
        if ch == "\n":
            line += 1
        if not header.strip() and not ch.isspace():
            header_line = line  # where the text before the next brace starts
        if ch == "{":
            h = " ".join(header.split())
            if any(entry[0] == "func" for entry in stack):
                kind = "block"
            elif re.search(r"\bnamespace\b", h) or h.startswith("extern"):
                kind = "ns"
            elif re.search(r"\b(class|struct|union|enum)\b[^()]*$", h):
                kind = "class"
            elif "(" in h and not CONTROL.search(h) and not h.endswith(("=", "]")):
                kind = "func"
            else:
                kind = "block"
            stack.append((kind, h, header_line if kind == "func" else line, line))
            header = ""
        elif ch == "}":
            if stack:
                kind, h, start, body = stack.pop()
                if kind == "func" and line - body + 1 > 0:
                    yield start, body, line, h
            header = ""
        elif ch == ";":
            header = ""
        else:
            header += ch


def python_functions(text):
    """(first line, last line, length without the docstring, name) of every function."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant):
                if isinstance(doc.value.value, str):
                    length -= doc.end_lineno - doc.lineno + 1
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield first, node.end_lineno, length, node.name


def argued(lines, first, last):
    """A "Long:" comment in the 12 lines above the function or in its body."""
    return any(ARGUED.match(line) for line in lines[max(0, first - 13) : last])


def main(argv):
    limit = next((int(a) for a in argv if a.isdigit()), 80)
    unargued_only = "--unargued" in argv
    files = subprocess.run(
        ["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.split()
    rows = []
    for name in files:
        path = REPO / name
        if not path.is_file():
            continue
        if name.endswith((".cc", ".h", ".c")):
            text = path.read_text(errors="replace")
            found = [(a, c, c - b + 1, h[:90]) for a, b, c, h in cpp_functions(text)]
        elif name.endswith(".py"):
            text = path.read_text(errors="replace")
            try:
                found = [(a, b, n, f"def {f}") for a, b, n, f in python_functions(text)]
            except SyntaxError:
                continue
        else:
            continue
        lines = text.splitlines()
        for first, last, length, what in found:
            if length > limit:
                ok = argued(lines, first, last)
                if not (unargued_only and ok):
                    rows.append((length, f"{name}:{first}", what, ok))
    for length, where, what, ok in sorted(rows, reverse=True):
        print(f"{length:5d} {'argued ' if ok else 'UNARGUED'} {where} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

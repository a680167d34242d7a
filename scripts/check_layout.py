"""Layout rules `make check` enforces (docs/architecture.md, "Rules the checks enforce"):

1. SQL lives in state/: no module outside src/astraflow/state/ passes an SQL statement to execute,
   executemany, executescript, query or scalar, or opens a database with sqlite3.connect.
2. No package cycles: in the import graph of src/astraflow (read from the AST, every import, lazy or
   not; a package is a first-level subpackage, a top-level module is its own node), no two packages
   reach each other.
3. No long module without a reason: a module over 400 lines (of the package or of tests/) says why in
   its docstring, in a sentence that starts "Over 400 lines because".
4. Every import of an astraflow module names one that exists (mypy runs with ignore_missing_imports, so
   a module moved by one change and imported under TYPE_CHECKING by another would pass it as Any).
5. No function over complexity 15 on the paths a newcomer starts from (cli/, launch/, roles/), counted
   with boolean operators too: 1 + each if, elif, ternary, loop (and its else), except handler (and a
   try's else), comprehension (and its ifs), match case, assert, and each `and`/`or` operand beyond the
   first. Ruff's C901 (pyproject.toml) holds every module to 15 without the boolean operators.

Each rule has an allow-list of what is not yet moved, with the reason. Run: python scripts/check_layout.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "astraflow"

SQL_METHODS = ("execute", "executemany", "executescript", "query", "scalar")
SQL_WORDS = (
    "SELECT",
    "INSERT",
    "UPDATE",
    "DELETE",
    "CREATE",
    "WITH",
    "PRAGMA",
    "BEGIN",
    "REPLACE",
    "DROP",
    "ALTER",
)

SQL_ALLOWED = {
    # not state.db: the control benchmark's measure of SQLite's own insert rate, in a scratch file
    "bench/control_limits.py": "SQLite's insert rate, measured on a scratch database of its own",
    # not state.db: a metric sink's own SQLite file, which the user names in the recipe
    "metrics/builtin_sinks.py": "the sqlite metric sink writes its own database, not state.db",
}

MAX_LINES = 400
LONG_ALLOWED: dict[str, str] = {}
"""Modules over MAX_LINES left out of the rule, each with why (none now)."""


CYCLES_ALLOWED: dict[tuple[str, str], str] = {}
"""Import edges left out of the cycle check, each with why it is still there."""


def _modules() -> list[tuple[str, ast.Module]]:
    return [
        (p.relative_to(SRC).as_posix(), ast.parse(p.read_text(), str(p))) for p in sorted(SRC.rglob("*.py"))
    ]


def _sql_text(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)
        )
    if isinstance(node, ast.BinOp):
        return _sql_text(node.left)
    return None


def sql_outside_state() -> list[str]:
    """'module:line' of every SQL statement executed outside state/ and not allowed."""
    out = []
    for rel, tree in _modules():
        if rel.startswith("state/") or rel in SQL_ALLOWED:
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            if (
                name == "connect"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "sqlite3"
            ):
                out.append(f"{rel}:{node.lineno}: sqlite3.connect")
            elif name in SQL_METHODS and node.args:
                text = _sql_text(node.args[0])
                if text is not None and text.lstrip().upper().startswith(SQL_WORDS):
                    out.append(f"{rel}:{node.lineno}: {name}({text.strip()[:60]!r}...)")
    return out


def long_without_reason() -> list[str]:
    """'module: N lines' of every module (the package's and the tests') over MAX_LINES whose docstring
    does not say why."""
    out = []
    tests = SRC.parents[1] / "tests"
    files = [(SRC / rel, rel) for rel, _ in _modules()]
    files += [(p, p.relative_to(tests.parent).as_posix()) for p in sorted(tests.rglob("*.py"))]
    for path, rel in files:
        text = path.read_text()
        n = len(text.splitlines())
        if n <= MAX_LINES or rel in LONG_ALLOWED:
            continue
        doc = ast.get_docstring(ast.parse(text, str(path))) or ""
        if "Over 400 lines because" not in " ".join(doc.split()):
            out.append(f"{rel}: {n} lines")
    return out


MAX_COMPLEXITY = 15
COMPLEXITY_PATHS = ("cli/", "launch/", "roles/")
"""The packages a newcomer reads first (cli -> launch -> roles): rule 5 holds them to MAX_COMPLEXITY."""

_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
"""Scored on their own, not as part of the function that holds them."""


def _decisions(node: ast.AST) -> int:
    """The decision points `node` itself adds (rule 5)."""
    if isinstance(node, (ast.If, ast.IfExp, ast.Assert)):
        return 1
    if isinstance(node, ast.BoolOp):
        return len(node.values) - 1
    if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
        return 1 + bool(node.orelse)
    if isinstance(node, (ast.Try, ast.TryStar)):
        return len(node.handlers) + bool(node.orelse)
    if isinstance(node, ast.comprehension):
        return 1 + len(node.ifs)
    if isinstance(node, ast.Match):
        wildcard = any(isinstance(c.pattern, ast.MatchAs) and c.pattern.pattern is None for c in node.cases)
        return max(0, len(node.cases) - wildcard)
    return 0


def complexity(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """1 + the decision points of the function's own body (a nested function or class is scored on its
    own; a lambda's body counts as the function's)."""
    total = 1
    todo: list[ast.AST] = [s for s in fn.body if not isinstance(s, _NESTED)]
    while todo:
        node = todo.pop()
        total += _decisions(node)
        todo.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, _NESTED))
    return total


def too_complex() -> list[str]:
    """'module:line: name (N)' of every function on COMPLEXITY_PATHS over MAX_COMPLEXITY."""
    out = []
    for rel, tree in _modules():
        if not rel.startswith(COMPLEXITY_PATHS):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = complexity(node)
                if n > MAX_COMPLEXITY:
                    out.append(f"{rel}:{node.lineno}: {node.name} ({n})")
    return out


def _module_exists(dotted: str) -> bool:
    rel = Path(*dotted.split(".")[1:])
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def unresolved_imports() -> list[str]:
    """'module:line: name' of every absolute import of an astraflow module that does not exist."""
    out = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] == "astraflow" and "." in name and not _module_exists(name):
                    out.append(f"{rel}:{node.lineno}: {name}")
    return out


def _package(module: str) -> str | None:
    """The node of a dotted module under astraflow: its first-level subpackage or top-level module."""
    parts = module.split(".")
    if parts[0] != "astraflow" or len(parts) < 2:
        return None
    if not ((SRC / parts[1]).is_dir() or (SRC / f"{parts[1]}.py").is_file()):
        return None  # a name defined in astraflow/__init__.py (__version__), not a module
    return parts[1]


def package_graph() -> dict[str, set[str]]:
    """Package -> packages it imports (every import statement, at any depth of the module)."""
    graph: dict[str, set[str]] = {}
    for rel, tree in _modules():
        src = rel[:-3].split("/")[0]
        graph.setdefault(src, set())
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolved against this module's package
                    here = rel[:-3].split("/")[:-1]
                    base = ["astraflow", *here[: len(here) - (node.level - 1)]]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names if mod == "astraflow"]
            for t in targets:
                dst = _package(t)
                if dst is not None and dst != src:
                    graph[src].add(dst)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def edges_in(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """The import edges that hold a cycle group together."""
    return [f"{a} -> {b}" for a in group for b in sorted(graph.get(a, ())) if b in group]


def main() -> int:
    """Print every breach of the rules; exit 1 if any."""
    bad = 0
    for line in sql_outside_state():
        print(f"SQL outside state/: {line}")
        bad += 1
    for line in unresolved_imports():
        print(f"import of a module that does not exist: {line}")
        bad += 1
    for line in too_complex():
        print(f"function over complexity {MAX_COMPLEXITY} on the newcomer's path: {line}")
        bad += 1
    for line in long_without_reason():
        print(f'long module without "Over 400 lines because" in its docstring: {line}')
        bad += 1
    graph = package_graph()
    for a, b in CYCLES_ALLOWED:
        graph.get(a, set()).discard(b)
    for group in cycles(graph):
        print(f"package cycle: {' <-> '.join(group)}: {', '.join(edges_in(group, graph))}")
        bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

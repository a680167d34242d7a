"""The layout rules `make check` enforces (scripts/check_layout.py): SQL only in state/, no package cycles,
no long module without a reason, every astraflow import resolves, no function over complexity 15 on
the newcomer's path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_layout", ROOT / "scripts" / "check_layout.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_sql_outside_state() -> None:
    assert _check().sql_outside_state() == []


def test_no_package_cycles_beyond_the_allowed_edges() -> None:
    check = _check()
    graph = check.package_graph()
    assert "tui" in graph and "state" in graph  # the graph was read at all
    for a, b in check.CYCLES_ALLOWED:
        graph[a].discard(b)
    assert check.cycles(graph) == []
    # the core never reaches the command line or the dashboard
    assert not {"cli", "tui"} & (graph["state"] | graph["dataflow"] | graph["transport"])


def test_the_cycle_finder_finds_cycles() -> None:
    check = _check()
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert check.cycles(graph) == [["a", "b", "c"]]
    assert check.cycles({"a": {"b"}, "b": set()}) == []


def test_every_long_module_says_why(tmp_path: Path) -> None:
    check = _check()
    assert check.long_without_reason() == []
    # the rule reads the docstring: a long module without the sentence is reported, with it is not
    pkg, tests = tmp_path / "src" / "astraflow", tmp_path / "tests"
    pkg.mkdir(parents=True)
    tests.mkdir()
    body = "x = 1\n" * (check.MAX_LINES + 5)
    for d in (pkg, tests):
        (d / "long.py").write_text('"""A module."""\n' + body)
        (d / "fine.py").write_text('"""A module.\n\nOver 400 lines because it must be.\n"""\n' + body)
    check.SRC = pkg
    assert check.long_without_reason() == [
        f"long.py: {check.MAX_LINES + 6} lines",
        f"tests/long.py: {check.MAX_LINES + 6} lines",
    ]


def test_every_astraflow_import_names_a_module_that_exists(tmp_path: Path) -> None:
    check = _check()
    assert check.unresolved_imports() == []
    # a module moved away but still imported (under TYPE_CHECKING, which mypy's ignore_missing_imports
    # lets pass as Any) is reported; a package and a module that exist are not
    pkg = tmp_path / "astraflow"
    (pkg / "state").mkdir(parents=True)
    (pkg / "state" / "__init__.py").write_text("")
    (pkg / "state" / "ledger.py").write_text("")
    (pkg / "user.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import astraflow.state\n"
        "from astraflow.state.ledger import Ledger\n"
        "if TYPE_CHECKING:\n"
        "    from astraflow.dataflow.ledger import Ledger\n"
    )
    check.SRC = pkg
    assert check.unresolved_imports() == ["user.py:5: astraflow.dataflow.ledger"]


def test_no_function_over_complexity_15_on_the_newcomers_path(tmp_path: Path) -> None:
    check = _check()
    assert check.too_complex() == []
    # boolean operators count (ruff's C901 does not count them); a nested function is scored on its own;
    # modules off the path are not checked
    branches = "".join(f"    if x == {i} and y or z:\n        return {i}\n" for i in range(5))
    nested = "    def inner():\n" + "".join(
        f"        if x == {i}:\n            return {i}\n" for i in range(20)
    )
    pkg = tmp_path / "astraflow"
    for sub in ("roles", "state"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "m.py").write_text(f"def f(x, y, z):\n{branches}\ndef g(x):\n{nested}    return inner\n")
    check.SRC = pkg
    # f: 1 + 5 ifs + 5 x 2 boolean operands = 16; g: 1; inner: 21
    assert check.too_complex() == ["roles/m.py:1: f (16)", "roles/m.py:14: inner (21)"]

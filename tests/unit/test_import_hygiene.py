"""`astraflow --help` and the light modules import nothing heavy; core code never imports the TUI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "transformers", "textual", "vllm", "sglang")
LIGHT_MODULES = (
    "astraflow.cli.main",
    "astraflow.config.load",
    "astraflow.protocol.codec",
    "astraflow.roles.controller",
    "astraflow.dataflow.advantages",
    "astraflow.losses.grpo",
    "astraflow.data.order",
    "astraflow.workflows.quickstart.workflow",
    "astraflow.launch.up",
)


def _imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; {code}; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return set(out.stdout.split())


def test_help_imports_nothing_heavy() -> None:
    mods = _imported_after("from astraflow.cli.main import app")
    assert not [m for m in HEAVY if m in mods]


def test_light_modules_import_nothing_heavy() -> None:
    code = "; ".join(f"import {m}" for m in LIGHT_MODULES)
    mods = _imported_after(code)
    assert not [m for m in HEAVY if m in mods], [m for m in HEAVY if m in mods]


def test_help_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "astraflow", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "join" in out.stdout


def test_core_never_imports_tui() -> None:
    src = Path(__file__).resolve().parents[2] / "src" / "astraflow"
    offenders = []
    for path in src.rglob("*.py"):
        rel = path.relative_to(src)
        if rel.parts[0] in ("tui",) or rel.as_posix() in ("cli/dash.py",):
            continue
        text = path.read_text()
        if "astraflow.tui" in text or "import textual" in text or "from textual" in text:
            offenders.append(rel.as_posix())
    assert offenders == []


def test_controller_state_opens_without_pandas(tmp_path: Path) -> None:
    """sqlite-utils would import pandas and numpy (a second of the controller's start-up); the store
    creates a run's schema without them."""
    db = tmp_path / "state.db"
    mods = _imported_after(
        f"from astraflow.state.store import Store; s = Store.open({str(db)!r}); "
        "assert 'migrations' in s.db.table_names(); s.close()"
    )
    # hidden only while sqlite_utils loads: a `None` left in sys.modules would be listed here too
    assert "sqlite_utils" in mods and "pandas" not in mods and "numpy" not in mods


def test_up_checks_engine_and_trainer_options_without_torch() -> None:
    root = Path(__file__).resolve().parents[2]
    mods = _imported_after(
        "from astraflow.config.load import load_recipe, validate_plugins; "
        f"validate_plugins(load_recipe({str(root / 'recipes/quickstart/recipe.toml')!r}))"
    )
    assert "astraflow.engines.torch_engine_config" in mods and "torch" not in mods

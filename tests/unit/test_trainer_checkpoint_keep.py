"""How many checkpoints a trainer keeps on disk (`policy.keep_checkpoints`)."""

from __future__ import annotations

from pathlib import Path

from astraflow.config.load import load_recipe
from astraflow.roles.trainer_checkpoint import latest_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]


class _Steps:
    """Stands in for a trainer: only its step count and the file it writes matter to retention."""

    def __init__(self) -> None:
        self.step_count = 0

    def save_checkpoint(self, path: Path) -> None:
        (path / "model.safetensors").write_bytes(str(self.step_count).encode())


def _steps(root: Path) -> list[int]:
    return sorted(int(d.name.split("-")[1]) for d in root.iterdir() if d.name.startswith("step-"))


def test_keep_newest_two_by_default_and_all_with_zero(tmp_path: Path) -> None:
    t = _Steps()
    for keep, root in ((2, tmp_path / "two"), (0, tmp_path / "all")):
        t.step_count = 0
        for _ in range(5):
            t.step_count += 1
            save_checkpoint(t, root, keep)
    assert _steps(tmp_path / "two") == [4, 5]
    assert _steps(tmp_path / "all") == [1, 2, 3, 4, 5]
    assert latest_checkpoint(tmp_path / "all") == tmp_path / "all" / "step-5"


def test_recipe_field_defaults_to_two() -> None:
    recipe = load_recipe(ROOT / "recipes" / "quickstart" / "recipe.toml", ["policy.keep_checkpoints=0"])
    assert recipe.policy[0].keep_checkpoints == 0
    assert load_recipe(ROOT / "recipes" / "quickstart" / "recipe.toml", []).policy[0].keep_checkpoints == 2

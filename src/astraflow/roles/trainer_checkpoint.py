"""A trainer's checkpoints on disk: step-N directories written atomically, the newest found by a marker."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint directory (step-N with a COMPLETE marker) under root."""
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for d in root.iterdir():
        m = re.fullmatch(r"step-(\d+)", d.name)
        if m and (d / "COMPLETE").is_file():
            k = int(m.group(1))
            if best is None or k > best[0]:
                best = (k, d)
    return None if best is None else best[1]


def save_checkpoint(trainer: Any, root: Path, keep: int = 2) -> Path:
    """Write step-N atomically (a COMPLETE marker last) and keep only the newest `keep` (0: all)."""
    import shutil

    step = trainer.step_count
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    trainer.save_checkpoint(tmp)
    (tmp / "COMPLETE").write_text(str(step))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    ckpts = sorted(
        (d for d in root.iterdir() if re.fullmatch(r"step-\d+", d.name)),
        key=lambda d: int(d.name.split("-")[1]),
    )
    for old in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final

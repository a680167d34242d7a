"""Exports of a long run stream: trajectories are written a page at a time as they are read, the
archive's files are opened one after another as the merge by id reaches them (not all at once), and
a failed export leaves what was at its path before."""

from __future__ import annotations

import csv
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from astraflow.metrics import export as export_mod
from astraflow.state import archive

pytest.importorskip("pyarrow")


def _rows(n: int, seen: list[int], part_sizes: list[int], part_dir: Path) -> Iterator[dict[str, Any]]:
    """n trajectory rows; before each, the size of the export's part file so far (0: none yet)."""
    for i in range(1, n + 1):
        parts = list(part_dir.glob(".*.part"))
        part_sizes.append(parts[0].stat().st_size if parts else 0)
        seen.append(i)
        yield {
            "id": i,
            "task_id": i // 4,
            "policy": "main",
            "prompt_key": f"k{i}",
            "reward": float(i % 2),
            "advantage": 0.5,
            "status": "consumed",
            "consumed_step": None if i % 7 == 0 else i // 16,
            "tokens": "[1, 2, 3]",
            "loss_mask": "[0, 1, 1]",
            "versions": "[-1, 0, 0]",
            "logprobs": "[0.0, -0.5, -0.5]",
        }


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_trajectories_are_written_while_they_are_read(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "state.db").write_bytes(b"")  # export checks that the run has one; the rows are the stand-in
    seen: list[int] = []
    sizes: list[int] = []
    monkeypatch.setattr(export_mod, "PAGE", 50)
    monkeypatch.setattr(
        export_mod, "trajectory_rows", lambda run_dir, text=True: _rows(400, seen, sizes, tmp_path)
    )
    path, n = export_mod.export(tmp_path, "trajectories", fmt, None, text=False)
    assert n == 400 and path == tmp_path / f"trajectories.{fmt}"
    # the file grew while rows were still being read: no export holds the whole run
    assert sizes[-1] - sizes[0] > 2000
    if fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        assert table.column("id").to_pylist() == seen
        assert table.column("consumed_step").to_pylist()[6] is None  # nullable, typed int64
        assert str(table.schema.field("reward").type) == "double"
        assert pq.ParquetFile(path).num_row_groups == 8  # a page at a time
    else:
        assert [int(r["id"]) for r in csv.DictReader(open(path))] == seen
    assert not list(tmp_path.glob(".*.part"))


def test_a_failed_export_leaves_the_file_that_was_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "state.db").write_bytes(b"")
    target = tmp_path / "out.csv"
    target.write_text("an earlier export\n")

    def broken(run_dir: Path, text: bool = True) -> Iterator[dict[str, Any]]:
        yield from _rows(120, [], [], tmp_path)
        raise OSError("disk went away")

    monkeypatch.setattr(export_mod, "trajectory_rows", broken)
    with pytest.raises(OSError, match="disk went away"):
        export_mod.export(tmp_path, "trajectories", "csv", target, text=False)
    assert target.read_text() == "an earlier export\n"
    assert not list(tmp_path.glob(".*.part"))


def test_archive_files_are_read_one_after_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real retention run (the in-process bench's controller, a pass every 10 steps keeping 2): every
    archived row comes out once, by id, while at most a couple of files are open at a time."""
    from astraflow.bench import control_inproc
    from astraflow.state.store import Store

    d = control_inproc._Driver(tmp_path, keep_steps=2)
    control_inproc.join(d)
    control_inproc.run_steps(d, 1, 62, random.Random(0), 3)
    d.ctl.store.close()
    open_now, most = 0, 0
    real = archive._file_rows

    def counted(path: Path) -> Iterator[dict[str, Any]]:
        nonlocal open_now, most
        open_now += 1
        most = max(most, open_now)
        yield from real(path)
        open_now -= 1

    monkeypatch.setattr(archive, "_file_rows", counted)
    store = Store.open_readonly(tmp_path / "state.db")
    try:
        n_files = len(archive.files(store))
        ids = [int(r["id"]) for r in archive.iter_rows(store, tmp_path)]
        archived = int(store.scalar("SELECT COALESCE(SUM(rows), 0) FROM archived WHERE file != ''"))
    finally:
        store.close()
    assert n_files >= 5
    assert ids == sorted(set(ids)) and len(ids) == archived > 0
    assert most <= 2 < n_files

"""Writing a run's metrics or trajectories as CSV or Parquet, for notebooks and spreadsheets."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError

FIRST = ("policy", "step", "version", "time")
"""Metric columns that lead every export; the rest follow sorted."""
PAGE = 5000
"""Trajectories read and written at a time: an export holds one page of rows, however long the run."""
TRAJECTORY = ("id", "task_id", "policy", "prompt_key", "reward", "advantage", "status", "consumed_step")
"""A trajectory row's columns besides its lists (JSON text) and decoded text."""
LISTS = ("tokens", "loss_mask", "versions", "logprobs")
TEXT = ("text", "generated")
_NUMBERS = {
    "id": "int64",
    "task_id": "int64",
    "consumed_step": "int64",
    "reward": "float64",
    "advantage": "float64",
}
"""Parquet types of a trajectory export's numeric columns (the others are text)."""


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every row of the run's metrics.jsonl."""
    from astraflow.metrics.log import read_all

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise AstraflowError(f"no metrics.jsonl in {run_dir}", hint="pass the run directory of a run")
    return read_all(path)


def trajectory_rows(run_dir: Path, page: int = PAGE, *, text: bool = True) -> Iterator[dict[str, Any]]:
    """Every trajectory of the run (in state.db or archived by a retention pass), by id, with token
    lists as JSON text (read in pages); with `text`, also decoded by its policy's tokenizer: `text` (the whole sequence, special tokens kept)
    and `generated` (a JSON list of the policy's turns: each run of trained tokens, decoded)."""
    from astraflow.state.views import every_sample, open_for_reading

    decoders = _Decoders(run_dir) if text else None
    store = open_for_reading(run_dir / "state.db", busy_timeout_s=5.0)
    try:
        for s in every_sample(store, page):
            row: dict[str, Any] = {
                "id": s.id,
                "task_id": s.task_id,
                "policy": s.policy,
                "prompt_key": s.prompt_key,
                "reward": s.reward,
                "advantage": s.advantage,
                "status": s.status,
                "consumed_step": s.consumed_step,
                "tokens": json.dumps(s.tokens),
                "loss_mask": json.dumps(s.loss_mask),
                "versions": json.dumps(s.versions),
                "logprobs": json.dumps(s.logprobs),
            }
            if decoders is not None:
                tok = decoders.get(s.policy)
                row["text"] = str(tok.decode(s.tokens))
                row["generated"] = json.dumps(
                    [str(tok.decode(run)) for run in _trained_runs(s.tokens, s.loss_mask)]
                )
            yield row
    finally:
        store.close()


def _trained_runs(tokens: list[int], mask: list[int]) -> list[list[int]]:
    """The maximal runs of tokens with loss mask 1 (the policy's turns), in order."""
    runs: list[list[int]] = []
    prev = 0
    for t, m in zip(tokens, mask, strict=False):
        if m:
            if not prev:
                runs.append([])
            runs[-1].append(t)
        prev = m
    return runs


class _Decoders:
    """Each policy's tokenizer, from the model directory the run's resolved recipe names (loaded once)."""

    def __init__(self, run_dir: Path) -> None:
        resolved = run_dir / "recipe.resolved.json"
        self.models: dict[str, str] = {}
        if resolved.is_file():
            recipe = json.loads(resolved.read_text())
            self.models = {str(p.get("name")): str(p.get("model", "")) for p in recipe.get("policy", [])}
        self.loaded: dict[str, Any] = {}

    def get(self, policy: str) -> Any:
        if policy not in self.loaded:
            model = self.models.get(policy, "")
            try:
                from transformers import AutoTokenizer

                self.loaded[policy] = AutoTokenizer.from_pretrained(model)
            except Exception as exc:
                raise AstraflowError(
                    f"cannot load the tokenizer of policy {policy!r} (model {model or '?'}) to decode its "
                    f"trajectories: {type(exc).__name__}: {exc}",
                    hint="export without decoded text: --no-text",
                ) from None
        return self.loaded[policy]


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """Leading columns first, then every other key seen, sorted."""
    return _ordered({k for r in rows for k in r})


def trajectory_columns(text: bool) -> list[str]:
    """A trajectory export's columns, in the order `columns` gives them."""
    return _ordered(set(TRAJECTORY + LISTS + (TEXT if text else ())))


def _ordered(seen: set[str]) -> list[str]:
    return [k for k in FIRST if k in seen] + sorted(seen - set(FIRST))


def write_csv(rows: Iterable[dict[str, Any]], cols: list[str], out: Path) -> int:
    """Write rows as CSV (missing values empty) as they come; returns the row count."""
    n = 0
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        for row in rows:
            w.writerow(row)
            n += 1
    return n


def write_parquet(rows: Iterable[dict[str, Any]], cols: list[str], out: Path, *, typed: bool = False) -> int:
    """Write rows as Parquet (needs pyarrow); returns the row count. `typed`: trajectory rows, written a
    PAGE at a time with their fixed types; otherwise the types are inferred from all the rows at once."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise AstraflowError(
            "--format parquet needs the pyarrow package", hint="pip install 'astraflow[parquet]' or use csv"
        ) from None
    if not typed:
        every = [{c: r.get(c) for c in cols} for r in rows]
        pq.write_table(pa.Table.from_pylist(every), out)
        return len(every)
    schema = pa.schema([(c, pa.type_for_alias(_NUMBERS.get(c, "string"))) for c in cols])
    n = 0
    with pq.ParquetWriter(out, schema) as writer:
        page: list[dict[str, Any]] = []
        for row in rows:
            page.append(row)
            if len(page) == PAGE:
                writer.write_table(pa.Table.from_pylist(page, schema=schema))
                n, page = n + len(page), []
        if page or not n:
            writer.write_table(pa.Table.from_pylist(page, schema=schema))
            n += len(page)
    return n


def export(run_dir: Path, what: str, fmt: str, out: Path | None, *, text: bool = True) -> tuple[Path, int]:
    """Export `what` (metrics | trajectories) of a run as `fmt` (csv | parquet); returns (file, rows).
    `text`: trajectories also decoded by their policies' tokenizers. Trajectories stream through one
    page at a time; the file appears under its name only once it is whole (a failed export leaves
    whatever was there before)."""
    if fmt not in ("csv", "parquet"):
        raise AstraflowError(f"unknown format {fmt!r}", hint="use --format csv or --format parquet")
    rows: Iterable[dict[str, Any]]
    if what == "metrics":
        listed = metric_rows(run_dir)
        rows, cols = listed, columns(listed)
    elif what == "trajectories":
        if not (run_dir / "state.db").is_file():
            raise AstraflowError(f"no state.db in {run_dir}", hint="pass the run directory of a run")
        rows, cols = trajectory_rows(run_dir, text=text), trajectory_columns(text)
    else:
        raise AstraflowError(f"cannot export {what!r}", hint="use --what metrics or --what trajectories")
    target = out or run_dir / f"{what}.{fmt}"
    part = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        if fmt == "csv":
            n = write_csv(rows, cols, part)
        else:
            n = write_parquet(rows, cols, part, typed=what == "trajectories")
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return target, n

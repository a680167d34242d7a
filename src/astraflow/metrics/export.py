"""Writing a run's metrics or trajectories as CSV or Parquet, for notebooks and spreadsheets."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError

FIRST = ("policy", "step", "version", "time")
"""Metric columns that lead every export; the rest follow sorted."""


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every row of the run's metrics.jsonl."""
    from astraflow.metrics.log import read_all

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise AstraflowError(f"no metrics.jsonl in {run_dir}", hint="pass the run directory of a run")
    return read_all(path)


def trajectory_rows(run_dir: Path, page: int = 5000, *, text: bool = True) -> Iterator[dict[str, Any]]:
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
    seen = {k for r in rows for k in r}
    return [k for k in FIRST if k in seen] + sorted(seen - set(FIRST))


def write_csv(rows: list[dict[str, Any]], out: Path) -> int:
    """Write rows as CSV (missing values empty); returns the row count."""
    cols = columns(rows)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        w.writerows(rows)
    return len(rows)


def write_parquet(rows: list[dict[str, Any]], out: Path) -> int:
    """Write rows as Parquet (needs pyarrow); returns the row count."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise AstraflowError(
            "--format parquet needs the pyarrow package", hint="pip install 'astraflow[parquet]' or use csv"
        ) from None
    cols = columns(rows)
    table = pa.Table.from_pylist([{c: r.get(c) for c in cols} for r in rows])
    pq.write_table(table, out)
    return len(rows)


def export(run_dir: Path, what: str, fmt: str, out: Path | None, *, text: bool = True) -> tuple[Path, int]:
    """Export `what` (metrics | trajectories) of a run as `fmt` (csv | parquet); returns (file, rows).
    `text`: trajectories also decoded by their policies' tokenizers."""
    if fmt not in ("csv", "parquet"):
        raise AstraflowError(f"unknown format {fmt!r}", hint="use --format csv or --format parquet")
    if what == "metrics":
        rows = metric_rows(run_dir)
    elif what == "trajectories":
        if not (run_dir / "state.db").is_file():
            raise AstraflowError(f"no state.db in {run_dir}", hint="pass the run directory of a run")
        rows = list(trajectory_rows(run_dir, text=text))
    else:
        raise AstraflowError(f"cannot export {what!r}", hint="use --what metrics or --what trajectories")
    target = out or run_dir / f"{what}.{fmt}"
    n = write_csv(rows, target) if fmt == "csv" else write_parquet(rows, target)
    return target, n

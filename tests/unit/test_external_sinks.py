"""The W&B (offline) and MLflow (file store) sinks: every metric row reaches the run's files.

wandb and mlflow are optional extras (`astraflow[wandb]`, `astraflow[mlflow]`: about 165 MB together),
not in `.[dev]`; without them these tests skip and say which extra to install."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from astraflow.metrics.sinks import Sinks

ROWS = [
    {"policy": p, "step": s, "version": s, "time": 1000.0 + s, "reward_mean": s / 10, "loss": -s / 100}
    for s in range(1, 5)
    for p in ("main", "critic")
]


def wandb_records(raw: bytes) -> list[bytes]:
    """The records of a .wandb file: a 7-byte file header, then LevelDB-style log records (4-byte CRC,
    2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    block, pos, out, part = 32768, 7, [], b""
    while pos + 7 <= len(raw):
        room = block - pos % block
        if room < 7:
            pos += room  # block trailer padding
            continue
        length = int.from_bytes(raw[pos + 4 : pos + 6], "little")
        kind = raw[pos + 6]
        body = raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        part = body if kind in (1, 2) else part + body
        if kind in (1, 4):
            out.append(part)
    return out


def test_mlflow_sink_writes_every_row_to_a_file_store(tmp_path: Path) -> None:
    pytest.importorskip(
        "mlflow", reason="the mlflow sink needs the `mlflow` extra: pip install 'astraflow[mlflow]'"
    )
    from mlflow.tracking import MlflowClient

    sinks = Sinks.from_specs([("mlflow", {"experiment": "t"})], tmp_path)
    for row in ROWS:
        sinks.write(row)
    sinks.close()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    for pol in ("main", "critic"):
        for key in ("reward_mean", "loss", "version"):
            got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"{pol}/{key}")]
            want = [(r["step"], float(r[key])) for r in ROWS if r["policy"] == pol]
            assert sorted(got) == want, (pol, key)


def test_wandb_sink_offline_writes_every_row_to_the_run_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip(
        "wandb", reason="the wandb sink needs the `wandb` extra: pip install 'astraflow[wandb]'"
    )
    from wandb.proto import wandb_internal_pb2

    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = Sinks.from_specs([("wandb", {"project": "t"})], tmp_path)
    for row in ROWS:
        sinks.write(row)
    sinks.close()
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records: list[wandb_internal_pb2.Record] = []
    deadline = time.monotonic() + 30
    # W&B's own writer process may still be flushing after finish(): wait for the run's exit record
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)
        records = []
        for data in wandb_records(log.read_bytes()):
            records.append(wandb_internal_pb2.Record())
            records[-1].ParseFromString(data)
    seen: list[tuple[str, int, float, float]] = []
    for rec in records:
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
        for pol in ("main", "critic"):
            if f"{pol}/step" in items:
                seen.append(
                    (
                        pol,
                        int(items[f"{pol}/step"]),
                        float(items[f"{pol}/reward_mean"]),
                        float(items[f"{pol}/loss"]),
                    )
                )
    want = [(r["policy"], r["step"], r["reward_mean"], r["loss"]) for r in ROWS]
    assert sorted(seen) == sorted(want)
    assert not os.environ.get("WANDB_API_KEY")  # offline: no account, no network

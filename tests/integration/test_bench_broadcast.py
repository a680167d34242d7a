"""`astraflow bench broadcast` on CPU (gloo): real engine processes receive every version with its
digest intact, and an engine killed mid-broadcast (SIGKILL) plus one that joins then leave every live
engine holding the next version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_broadcast_reaches_every_engine_and_survives_churn() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "astraflow", "bench", "broadcast", "--preset", "tiny", "--engines", "2"]
    cmd += ["--repeats", "2", "--churn", "--timeout-s", "5", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=220)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    (row,) = res["rows"]
    assert row["digest_mismatches"] == []
    assert row["bytes"] > 0 and len(row["seconds_all"]) == 2
    churn = row["churn"]
    # the killed engine is gone, the survivor and the newcomer both hold the version after it
    assert churn["engines_after"] == ["engine-1", "engine-new"]
    assert res["allreduce_bus_gbs"] > 0

"""`astraflow bench rollout` through the real CLI: a JSON row per batch with both decode loops timed
and compared, and clear user errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run `python -m astraflow ARGS` with one torch thread and offline HF."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "astraflow", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def test_rollout_bench_json_on_cpu(tiny_model: Path) -> None:
    out = run_cli(
        "bench",
        "rollout",
        "--model",
        str(tiny_model),
        "--batch",
        "1,4",
        "--prompt-len",
        "6",
        "--new-tokens",
        "8",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    # With --json the table goes to stderr so stdout stays parseable.
    assert "engine/HF" in out.stderr
    assert res["device"] == "cpu"
    assert res["new_tokens"] == 8 and res["prompt_len"] == 6
    assert res["loops"] == ["sync", "overlap"]  # the default --loop both
    assert res["param_bytes"] > 0 and res["kv_bytes_per_token"] > 0 and res["bandwidth_gb_s"] > 0
    assert [r["batch"] for r in res["rows"]] == [1, 4]
    for row in res["rows"]:
        assert row["ratio"] > 0 and row["bound_ms_per_step"] > 0 and row["kv_bytes_per_step"] > 0
        for gen in ("engine", "hf"):
            t = row[gen]
            for key in ("total_s", "prefill_s", "ms_per_step", "decode_tok_s", "e2e_tok_s", "bound_frac"):
                assert t[key] > 0, (gen, key, t)
            assert t["prefill_s"] < t["total_s"]
            # tokens/s and ms/step describe the same decode phase
            assert t["decode_tok_s"] == pytest.approx(row["batch"] * 1e3 / t["ms_per_step"], rel=1e-6)
        assert row["ratio"] == pytest.approx(row["engine"]["decode_tok_s"] / row["hf"]["decode_tok_s"])
        # the engine columns are the synchronous loop's; the overlapped loop is timed beside it
        assert row["loops"]["sync"] == row["engine"] and row["loops"]["overlap"]["decode_tok_s"] > 0
        ratio = row["loops"]["overlap"]["decode_tok_s"] / row["loops"]["sync"]["decode_tok_s"]
        assert row["overlap_vs_sync"] == pytest.approx(ratio)
        # equal-length rows make the same batches in both loops: the same numbers, bit for bit
        assert row["loops_agree"] is True and row["max_logprob_diff"] == 0.0
    # A bigger batch reads more KV per step, so its bound is higher.
    assert res["rows"][1]["kv_bytes_per_step"] == pytest.approx(4 * res["rows"][0]["kv_bytes_per_step"])


def test_rollout_bench_bad_loop(tiny_model: Path) -> None:
    out = run_cli("bench", "rollout", "--model", str(tiny_model), "--device", "cpu", "--loop", "async")
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("error: unknown --loop 'async'"), out.stderr
    assert "hint:" in out.stderr


def test_rollout_bench_missing_model(tmp_path: Path) -> None:
    out = run_cli("bench", "rollout", "--model", str(tmp_path / "nope"), "--device", "cpu")
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("error: no model found"), out.stderr
    assert "hint:" in out.stderr and "astraflow model init" in out.stderr


def test_rollout_bench_cuda_without_gpu(tiny_model: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = run_cli("bench", "rollout", "--model", str(tiny_model), "--device", "cuda", "--new-tokens", "2")
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("error: --device cuda"), out.stderr
    assert "hint:" in out.stderr

"""Prometheus text from the status document, served over real HTTP on loopback."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from astraflow.errors import AstraflowError
from astraflow.metrics.prometheus import render, serve
from tests.ports import free_port

DOC: dict[str, Any] = {
    "run": {"name": 'q"s'},
    "tasks": {"queued": 3, "leased": 4, "done": 10, "failed": 0},
    "policies": [{"name": "main", "step": 7, "version": 7, "reward_mean": None}],
    "members": [{"role": "raas", "status": "alive"}, {"role": "raas", "status": "alive"}],
    "buffers": {"main": {"buffered": 2}},
    "demand": {
        "queued": 3,
        "waiting": 1,  # two of the queued tasks feed a paused policy
        "leased": 4,
        "raas": 2,
        "slots": 4,
        "busy_slots": 4,
        "idle_fraction": 0.0,
        "workers": [{"id": "raas-0", "leased": 2}],
        "room": {"main": 1},
        "pace": {"main": None},
    },
}


def _samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"
    }


def test_render_gauges_and_escapes_labels() -> None:
    text = render(DOC)
    s = _samples(text)
    run = 'run="q\\"s"'
    assert s[f"astraflow_up{{{run}}}"] == 1
    assert s[f"astraflow_slot_demand{{{run}}}"] == 5  # waiting + leased: paused tasks ask for no slot
    assert s[f'astraflow_tasks{{{run},status="queued"}}'] == 3
    assert s[f'astraflow_admission_room{{{run},policy="main"}}'] == 1
    assert s[f'astraflow_raas_leased{{{run},member="raas-0"}}'] == 2
    assert s[f'astraflow_members{{{run},role="raas",status="alive"}}'] == 2
    # an unknown value has its HELP and TYPE but no sample
    assert "# TYPE astraflow_policy_reward_mean gauge" in text
    assert not any(k.startswith("astraflow_policy_reward_mean{") for k in s)
    assert not any(k.startswith("astraflow_policy_steps_per_minute{") for k in s)
    assert text.count("# TYPE astraflow_tasks gauge") == 1


def test_served_over_http_and_down_when_the_controller_does_not_answer() -> None:
    answers: list[dict[str, Any] | None] = [DOC]

    def fetch() -> dict[str, Any] | None:
        doc = answers[-1]
        if doc is None:
            raise AstraflowError("no answer")
        return doc

    port = free_port()
    server = serve(f"127.0.0.1:{port}", fetch)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert 'astraflow_raas_workers{run="q\\"s"} 2' in r.read().decode()
        answers.append(None)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert 'astraflow_up{run=""} 0' in body and "astraflow_tasks" not in body
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
        assert err.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_bad_bind_is_a_clear_error() -> None:
    with pytest.raises(AstraflowError, match="is not HOST:PORT"):
        serve("9600", lambda: None)


def test_metrics_serve_command_reads_a_run_directory(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    from astraflow.state.ledger import Ledger
    from astraflow.state.store import Store

    store = Store.open(tmp_path / "state.db")
    store.init_run("demo", {"run": {"steps": 3}})
    Ledger(store).enqueue("a", {}, {"actor": "main"}, 1)
    store.close()
    port = free_port()
    cmd = [sys.executable, "-m", "astraflow", "metrics-serve", "--bind", f"127.0.0.1:{port}"]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "exactly one of --run-dir or --controller" in bad.stderr
    proc = subprocess.Popen(
        [*cmd, "--run-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                    body = r.read().decode()
                break
            except urllib.error.URLError:
                assert proc.poll() is None and time.monotonic() < deadline, (
                    proc.stdout.read() if proc.stdout else ""
                )
                time.sleep(0.1)
        assert 'astraflow_tasks{run="demo",status="queued"} 1' in body
        assert 'astraflow_slot_demand{run="demo"} 1' in body
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0

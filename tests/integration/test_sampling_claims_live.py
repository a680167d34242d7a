"""Sampling settings through real processes: a third-party workflow that overrides top-k on every turn
runs in a real RaaS, and its sequences reach the controller's store with that top-k; a rogue member
sends results whose settings the task did not allow (a temperature of 1e-300, one outside the
recipe's bounds, a top-p the recipe does not let calls change) and the controller refuses each with a
reason that names it, while a result inside the bounds is accepted."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import zmq

from astraflow.protocol import messages as m
from tests.chaos.cluster import Cluster, ro
from tests.security.peers import Peer

PLUGIN = Path(__file__).resolve().parents[1] / "plugins" / "astraflow-topk-turns"


def _register(site: Path) -> Path:
    """The example workflow package made importable and registered (a .dist-info directory with its
    entry point) on a path the test's processes get in PYTHONPATH: no pip, no change to the venv."""
    info = site / "astraflow_topk_turns-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: astraflow-topk-turns\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[astraflow.workflows]\ntopk_turns = astraflow_topk_turns:TopKTurnsWorkflow\n"
    )
    return site


def _sequence(sampling: m.SamplingParams) -> m.Sequence:
    return m.Sequence(
        policy="main",
        tokens=[1, 14, 5, 6],
        loss_mask=[0, 0, 1, 1],
        logprobs=[0.0, 0.0, -0.5, -0.7],
        versions=[-1, -1, 0, 0],
        reward=1.0,
        sampling=sampling,
    )


@pytest.mark.timeout(300)
def test_settings_a_task_did_not_allow_are_refused_and_per_turn_top_k_travels(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = _register(tmp_path / "site")
    path = os.pathsep.join([str(PLUGIN / "src"), str(site), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    group = 4
    overrides = (
        'workflow.name="topk_turns"',
        f"policy.group_size={group}",
        "policy.batch_prompts=4",
        "rollout.slots=4",
        "policy.sampling.overrides.top_k=true",
        "policy.sampling.overrides.top_p=false",
    )
    ctx = zmq.Context()
    try:
        with Cluster(tmp_path, tiny_model, 2, *overrides) as c:
            ctl = c.controller()
            deadline = time.monotonic() + 120
            while not (c.run_dir / "controller.addr").exists():
                assert ctl.poll() is None and time.monotonic() < deadline, c.log("controller.log")
                time.sleep(0.05)

            rogue = Peer(ctx, c.addr, "rogue")
            assert isinstance(rogue.hello("raas"), m.Welcome)
            grant = rogue.ask(m.TaskRequest(n=4, loaded={"main": 0}))
            assert isinstance(grant, m.TaskGrant) and len(grant.tasks) == 4, grant
            # the quickstart recipe samples at temperature 1.2
            claims = [
                (m.SamplingParams(temperature=1e-300), "temperature 1e-300 is not a finite number >= 0.01"),
                (m.SamplingParams(temperature=3.0), "policy.sampling.overrides.temperature [0.01, 2.0]"),
                (m.SamplingParams(temperature=1.2, top_p=0.5), "policy.sampling.overrides.top_p is false"),
            ]
            for task, (sampling, reason) in zip(grant.tasks, claims, strict=False):
                episodes = [m.Episode(sequences=[_sequence(sampling)]) for _ in range(group)]
                r = rogue.ask(m.TaskResult(task_id=task.task_id, epoch=task.epoch, episodes=episodes))
                assert isinstance(r, m.Error) and r.code == "bad_result", r
                assert "sampling settings not allowed by the task" in r.message and reason in r.message, r
            # inside the bounds: another temperature, and top-k, which this recipe lets calls change
            allowed = m.SamplingParams(temperature=0.9, top_k=5)
            last = grant.tasks[3]
            episodes = [m.Episode(sequences=[_sequence(allowed)]) for _ in range(group)]
            r = rogue.ask(m.TaskResult(task_id=last.task_id, epoch=last.epoch, episodes=episodes))
            assert isinstance(r, m.ResultAck) and r.status == "accepted", r
            rogue.ask(m.Bye(reason="done"))
            rogue.close()
            with ro(c.run_dir) as db:
                errors = [e for (e,) in db.execute("SELECT error FROM tasks WHERE error != '' ORDER BY id")]
            # each refusal is a failed attempt with its reason, the task queued again
            assert len(errors) == 3 and all("sampling settings not allowed" in e for e in errors), errors

            # a real worker runs the workflow: two turns per sequence, each sampled with top_k = 5
            raas = c.raas(0)
            rows: list[tuple[float, float, int]] = []
            deadline = time.monotonic() + 180
            while len(rows) < 2 * group and time.monotonic() < deadline:
                assert raas.poll() is None, c.log("raas-0.log")
                assert ctl.poll() is None, c.log("controller.log")
                time.sleep(0.2)
                with ro(c.run_dir) as db:
                    rows = db.execute(
                        "SELECT temperature, top_p, top_k FROM trajectories WHERE temperature = 1.2"
                    ).fetchall()
            assert len(rows) >= 2 * group, c.log("raas-0.log") + c.log("controller.log")
            assert set(rows) == {(1.2, 1.0, 5)}, rows
            with ro(c.run_dir) as db:
                rogue_rows = db.execute(
                    "SELECT temperature, top_p, top_k FROM trajectories WHERE temperature != 1.2"
                ).fetchall()
            assert rogue_rows == [(0.9, 1.0, 5)] * group, "only the allowed forged result is stored"
    finally:
        ctx.destroy(linger=0)

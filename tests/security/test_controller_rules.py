"""The controller's rules, driven through Controller.handle on a real state.db (no sockets): each
attack of a peer that joined without keys is refused and changes nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from astraflow.state.store import Store
from astraflow.transport.principal import Principal


def _recipe(model: Path, **rollout: object) -> Recipe:
    return Recipe.model_validate(
        {
            "run": {"name": "rules", "steps": 3},
            "policy": [{"name": "main", "model": str(model), "group_size": 2, "batch_prompts": 1}],
            "workflow": {"name": "quickstart", "options": {"size": 50}},
            "rollout": {"lease_timeout_s": 5.0, "slots": 2, "max_attempts": 5, **rollout},
            "controller": {"member_timeout_s": 30.0, "forget_after_s": 1.0},
        }
    )


@pytest.fixture()
def ctl(tiny_model: Path, tmp_path: Path) -> Controller:
    store = Store.open(tmp_path / "state.db")
    c = Controller(_recipe(tiny_model), tmp_path, store)
    c.start()
    return c


def ask(c: Controller, ident: str, msg: m.Msg, principal: Principal | None = None) -> m.Msg:
    reply = c.handle(ident.encode(), msg, principal)
    assert reply is not None
    return reply


def hello(ident: str, role: str, policies: list[str] | None = None, pid: int = 1, **kw: object) -> m.Hello:
    return m.Hello(
        member_id=ident,
        role=role,
        protocol=m.PROTOCOL_VERSION,
        policies=["main"] if policies is None else policies,
        pid=pid,
        host="h",
        **kw,  # type: ignore[arg-type]
    )


def seq(tokens: list[int], version: int = 0, **kw: object) -> m.Sequence:
    n = len(tokens)
    fields: dict[str, object] = {
        "policy": "main",
        "tokens": tokens,
        "loss_mask": [0] + [1] * (n - 1),
        "logprobs": [0.0] + [-0.5] * (n - 1),
        "versions": [-1] + [version] * (n - 1),
        "reward": 1.0,
    }
    fields.update(kw)
    return m.Sequence(**fields, sampling=m.SamplingParams())  # type: ignore[arg-type]


def good(n: int = 2, tokens: list[int] | None = None) -> list[m.Episode]:
    return [m.Episode(sequences=[seq(tokens or [5, 6, 7])]) for _ in range(n)]


def lease(c: Controller, ident: str, n: int = 1) -> list[m.Task]:
    g = ask(c, ident, m.TaskRequest(n=n, loaded={"main": 0}))
    assert isinstance(g, m.TaskGrant), g
    return g.tasks


def test_trainer_rules_versions_steps_and_batches(ctl: Controller) -> None:
    assert isinstance(ask(ctl, "trainer-main", hello("trainer-main", "trainer")), m.Welcome)
    # a second trainer for the policy while the first is alive
    second = ask(ctl, "evil", hello("evil", "trainer"))
    assert isinstance(second, m.Error) and second.code == "trainer_taken"
    # a worker may not act as a trainer
    assert isinstance(ask(ctl, "w", hello("w", "raas")), m.Welcome)
    for msg in (
        m.BatchRequest(policy="main", step=1),
        m.VersionPublished(policy="main", version=1, step=1, weights_addr="tcp://x:1"),
    ):
        r = ask(ctl, "w", msg)
        assert isinstance(r, m.Error) and r.code == "not_authorized", r
    # the real trainer: only the next step's batch, only the next version, never the budget at once
    r = ask(ctl, "trainer-main", m.BatchRequest(policy="main", step=3))
    assert isinstance(r, m.Error) and r.code == "bad_step"
    for version, step in ((1000, 1), (1, 3), (3, 3), (1, 1)):  # (1, 1): its batch was not taken yet
        r = ask(
            ctl,
            "trainer-main",
            m.VersionPublished(policy="main", version=version, step=step, weights_addr=""),
        )
        assert isinstance(r, m.Error) and r.code == "bad_version", (version, step, r)
    assert not ctl.finished() and ctl.store.policy("main")["step"] == 0
    # produce one batch through the real path, then step 1 is the next version
    for t in lease(ctl, "w", 2):
        assert (
            ask(ctl, "w", m.TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=good())).status
            == "accepted"
        )  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    b = ask(ctl, "trainer-main", m.BatchRequest(policy="main", step=1))
    while not (isinstance(b, m.BatchReply) and b.ready) and time.monotonic() < deadline:
        b = ask(ctl, "trainer-main", m.BatchRequest(policy="main", step=1))
    assert isinstance(b, m.BatchReply) and b.ready
    again = ask(ctl, "trainer-main", m.BatchRequest(policy="main", step=1))  # resume: the recorded one
    assert [s.traj_id for s in again.samples] == [s.traj_id for s in b.samples]  # type: ignore[attr-defined]
    # step 1's version may still be publishing: step 2 may be asked for, never step 3
    r = ask(ctl, "trainer-main", m.BatchRequest(policy="main", step=3))
    assert isinstance(r, m.Error) and r.code == "bad_step"  # two versions ahead
    r = ask(ctl, "trainer-main", m.BatchRequest(policy="main", step=2))
    assert not isinstance(r, m.Error), r
    pub = m.VersionPublished(policy="main", version=1, step=1, weights_addr="tcp://a:1")
    assert isinstance(ask(ctl, "trainer-main", pub), m.Ack)
    # a restarted trainer re-announces a known version at a new address: accepted; another step: not
    re = m.VersionPublished(policy="main", version=1, step=1, weights_addr="tcp://b:1")
    assert ask(ctl, "trainer-main", re).detail == "known"  # type: ignore[attr-defined]
    r = ask(ctl, "trainer-main", m.VersionPublished(policy="main", version=1, step=2, weights_addr=""))
    assert isinstance(r, m.Error) and r.code == "bad_version"
    assert ctl.versions()[0].weights_addr == "tcp://b:1"


def test_keys_bind_role_policy_and_name(ctl: Controller) -> None:
    key = Principal(name="raas-0", role="raas")
    r = ask(ctl, "raas-0", hello("raas-0", "trainer"), key)
    assert isinstance(r, m.Error) and r.code == "not_authorized"
    r = ask(ctl, "raas-9", hello("raas-9", "raas"), key)
    assert isinstance(r, m.Error) and r.code == "bad_identity"
    tkey = Principal(name="t", role="trainer", policy="other")
    r = ask(ctl, "t", hello("t", "trainer"), tkey)
    assert isinstance(r, m.Error) and r.code in ("not_authorized", "unknown_policy")
    assert isinstance(ask(ctl, "raas-0", hello("raas-0", "raas"), key), m.Welcome)
    r = ask(ctl, "raas-0", m.BatchRequest(policy="main", step=1), key)
    assert isinstance(r, m.Error) and r.code == "not_authorized"
    obs = Principal(name="ops", role="observer")
    assert isinstance(ask(ctl, "ops", m.StatusRequest(), obs), m.StatusReply)


def test_worker_quota_renewal_takeover_and_validation(ctl: Controller, tiny_model: Path) -> None:
    assert isinstance(ask(ctl, "w", hello("w", "raas", slots=2)), m.Welcome)
    held = lease(ctl, "w", 1024)
    assert len(held) == 2  # its declared slots, not 1,024
    assert lease(ctl, "w", 1024) == []  # nothing more while it holds them
    # a Hello under the live id from another process is refused and takes nothing
    r = ask(ctl, "w", hello("w", "raas", pid=999))
    assert isinstance(r, m.Error) and r.code == "member_id_in_use"
    owners = {row["owner"] for row in ctl.store.query("SELECT owner FROM tasks WHERE status = 'leased'")}
    assert owners == {"w"}
    # heartbeats renew only the leases they report progress on
    expiry = lambda tid: ctl.store.scalar("SELECT lease_expiry FROM tasks WHERE id = ?", (tid,))  # noqa: E731
    before = [expiry(t.task_id) for t in held]
    time.sleep(0.05)
    ask(ctl, "w", m.Heartbeat(loaded={"main": 0}, active=[held[0].task_id]))
    assert expiry(held[0].task_id) > before[0] and expiry(held[1].task_id) == before[1]

    def bad(task: m.Task, episodes: list[m.Episode]) -> str:
        r = ask(ctl, "w", m.TaskResult(task_id=task.task_id, epoch=task.epoch, episodes=episodes))
        assert isinstance(r, m.Error) and r.code == "bad_result", r
        return r.message

    vocab = int(__import__("json").loads((tiny_model / "config.json").read_text())["vocab_size"])
    assert "outside the vocabulary" in bad(held[0], good(tokens=[5, vocab + 7, 3]))
    assert "episodes" in bad(held[1], good(n=5))
    (t,) = lease(ctl, "w", 1)
    mismatched = [m.Episode(sequences=[seq([5, 6, 7], logprobs=[0.0, -1.0])])] * 2
    assert "lengths differ" in bad(t, mismatched)
    (t,) = lease(ctl, "w", 1)
    assert "version" in bad(t, [m.Episode(sequences=[seq([5, 6, 7], version=1000)])] * 2)
    (t,) = lease(ctl, "w", 1)
    assert "logprobs" in bad(
        t, [m.Episode(sequences=[seq([5, 6, 7], logprobs=[0.0, 0.5, float("nan")])])] * 2
    )
    (t,) = lease(ctl, "w", 1)
    assert "policy" in bad(t, [m.Episode(sequences=[seq([5, 6, 7], policy="other")])] * 2)
    assert int(ctl.store.scalar("SELECT COUNT(*) FROM trajectories")) == 0  # nothing reached the buffer
    doc = ask(ctl, "w", m.StatusRequest()).status  # type: ignore[attr-defined]
    assert doc["failures"]["by_reason"] == {"invalid_result": 6}
    # a lapsed lease still takes its owner's late result: a forged one is checked all the same
    (t,) = lease(ctl, "w", 1)
    ctl.tick(time.time() + 6.0)
    assert ctl.ledger.get(t.task_id).status == "queued"  # type: ignore[union-attr]
    assert "outside the vocabulary" in bad(t, good(tokens=[5, vocab, 3]))
    assert int(ctl.store.scalar("SELECT COUNT(*) FROM trajectories")) == 0


def test_silent_and_huge_hellos_are_capped_and_pruned(ctl: Controller) -> None:
    big = ask(ctl, "big", hello("big", "raas", hardware="x" * 9_000_000, region="r" * 100_000))
    assert isinstance(big, m.Welcome)
    row = ctl.store.member("big")
    assert row is not None and len(row["hardware"]) <= 128 and len(row["region"]) <= 128
    t0 = time.monotonic()
    for i in range(4000):
        assert isinstance(ask(ctl, f"ghost-{i}", hello(f"ghost-{i}", "raas")), m.Welcome)
    print(f"4000 Hellos handled in {time.monotonic() - t0:.1f}s")
    assert len(ctl.store.members()) == 4001
    # silent past member_timeout_s: dead; forgotten after forget_after_s
    later = time.time() + 31.0
    ctl.tick(later)
    ctl.tick(later + 5.0)
    assert ctl.store.members() == []
    assert len(str(ask(ctl, "x", m.StatusRequest()).status)) < 2000  # type: ignore[attr-defined]


def test_failed_workflow_ends_the_run(tiny_model: Path, tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    c = Controller(_recipe(tiny_model, max_attempts=2, max_failed_tasks=2), tmp_path, store)
    c.start()
    assert isinstance(ask(c, "w", hello("w", "raas", slots=2)), m.Welcome)
    tb = "Traceback (most recent call last):\n  File \"wf.py\", line 1\nKeyError: 'answer'"
    while c.failed is None:
        tasks = lease(c, "w", 2)
        assert tasks, "no task leased before the run failed"
        for t in tasks:
            ask(c, "w", m.TaskResult(task_id=t.task_id, epoch=t.epoch, error=tb))
    assert "KeyError" in c.failed
    assert ask(c, "w", m.Heartbeat()).stop  # type: ignore[attr-defined]
    assert ask(c, "w", m.TaskRequest(n=1)).stop  # type: ignore[attr-defined]
    doc = ask(c, "w", m.StatusRequest()).status  # type: ignore[attr-defined]
    assert doc["failures"]["by_reason"] == {"workflow_error": 4}

"""Held-out evaluation: the pass@k estimator, and eval rounds driven through Controller.handle on a
real state.db (no sockets; the test plays the RaaS and trainer members with hand-made results)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from astraflow.config.recipe import Recipe
from astraflow.dataflow.evaluation import EvalSections, identity, pass_at_k
from astraflow.protocol import messages as m
from astraflow.roles.controller import Controller
from astraflow.state.status import build_status
from astraflow.state.store import Store


def test_pass_at_k_equals_the_subset_probability() -> None:
    # pass@k is the chance that k of the n samples, drawn without replacement, hold a correct one
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
                want = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(want)
    assert pass_at_k(4, 1, 9) == 1.0 and pass_at_k(4, 0, 9) == 0.0  # k past n: all n samples


def _recipe(model: Path) -> Recipe:
    return Recipe.model_validate(
        {
            "run": {"name": "evals", "steps": 1},
            "policy": [{"name": "main", "model": str(model), "group_size": 2, "batch_prompts": 1}],
            # 40 prompts of one digit: the 3 held-out ones (seed 1) surely recur among training ones
            "workflow": {"name": "quickstart", "options": {"size": 40, "length": 1}},
            "rollout": {"lease_timeout_s": 30.0, "slots": 8},
            # one worker takes eval and training tasks in one lease here: no share cap between the two
            "controller": {"member_timeout_s": 30.0, "max_member_share": 1.0},
            "eval": {
                "max_tasks": 3,
                "samples": 2,
                "k": [1, 2],
                "sampling": {"temperature": 0.5},
            },
        }
    )


def test_eval_sections_pick_what_evaluation_reads() -> None:
    raw = _recipe(Path("m")).model_dump()
    raw["run"].update(seed=7, steps=5)
    raw["policy"].append({**raw["policy"][0], "name": "frozen", "trainable": False})
    rec = Recipe.model_validate(raw)
    sec = EvalSections.of(rec)
    assert sec.eval == rec.eval and sec.workflow == rec.workflow and sec.seed == 7
    assert sec.trainable == ["main"] and sec.budgets == {"main": 5, "frozen": 0}
    with pytest.raises(ValueError, match=r"no \[eval\] table"):
        EvalSections.of(rec.model_copy(update={"eval": None}))


def ask(c: Controller, ident: str, msg: m.Msg) -> m.Msg:
    reply = c.handle(ident.encode(), msg)
    assert reply is not None
    return reply


def join(c: Controller, ident: str, role: str) -> None:
    hello = m.Hello(
        member_id=ident, role=role, protocol=m.PROTOCOL_VERSION, policies=["main"], pid=1, host="h"
    )
    assert isinstance(ask(c, ident, hello), m.Welcome)


def lease(c: Controller, ident: str, loaded: int, n: int = 8) -> list[m.Task]:
    g = ask(c, ident, m.TaskRequest(n=n, loaded={"main": loaded}))
    assert isinstance(g, m.TaskGrant), g
    return g.tasks


def episodes(rewards: list[float], version: int = 0) -> list[m.Episode]:
    seq = lambda r: m.Sequence(  # noqa: E731
        policy="main",
        tokens=[5, 6, 7],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.5],
        versions=[-1, version, version],
        reward=r,
        sampling=m.SamplingParams(),
    )
    return [m.Episode(sequences=[seq(r)]) for r in rewards]


def result(c: Controller, ident: str, t: m.Task, rewards: list[float], version: int = 0) -> str:
    r = ask(c, ident, m.TaskResult(task_id=t.task_id, epoch=t.epoch, episodes=episodes(rewards, version)))
    assert isinstance(r, m.ResultAck), r
    return r.status


def test_eval_rounds_through_the_controller(tiny_model: Path, tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    ctl = Controller(_recipe(tiny_model), tmp_path, store)
    ctl.start()
    held_out = ctl.evals.identities() if ctl.evals else set()
    assert len(ctl.evals.items if ctl.evals else []) == 3
    join(ctl, "w1", "raas")
    join(ctl, "w2", "raas")
    join(ctl, "trainer-main", "trainer")

    # version 0's round was queued at start: eval.samples per task, eval.sampling carried, never trained
    first = lease(ctl, "w1", loaded=0)
    evals = [t for t in first if t.sampling]
    train = [t for t in first if not t.sampling]
    assert len(evals) == 3 and train
    assert all(t.group_sizes == {"main": 2} and t.sampling == {"temperature": 0.5} for t in evals)
    assert all(t.group_sizes == {"main": 2} and t.read_only == [] for t in train)
    # held-out samples never reach training, though the generated set repeats them
    rows = store.query("SELECT prompt_key, sample FROM tasks")
    train_ids = [identity(json.loads(r["sample"])) for r in rows if not r["prompt_key"].startswith("eval/")]
    assert train_ids and not set(train_ids) & held_out
    assert {identity(t.sample) for t in evals} == held_out
    # admission does not count eval tasks as outstanding training work
    open_train = store.scalar(
        "SELECT COUNT(*) FROM tasks WHERE status IN ('queued', 'leased') AND prompt_key NOT LIKE 'eval/%'"
    )
    assert ctl.admission.outstanding()["main"] == 2 * open_train

    # w1 dies (says Bye) holding the eval tasks: they go back to the queue and w2 finishes them
    assert isinstance(ask(ctl, "w1", m.Bye(reason="killed")), m.Ack)
    second = lease(ctl, "w2", loaded=0)
    again = [t for t in second if t.sampling]
    assert sorted(t.task_id for t in again) == sorted(t.task_id for t in evals)
    for t, rs in zip(again, ([1.0, 0.0], [0.0, 0.0], [1.0, 1.0]), strict=True):
        assert result(ctl, "w2", t, rs) == "accepted"
    assert result(ctl, "w2", again[0], [0.0, 0.0]) == "duplicate"
    ctl.tick()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    row = rows[-1]
    assert row["kind"] == "eval" and row["version"] == 0 and row["eval/tasks"] == 3
    assert row["eval/avg@2"] == pytest.approx(0.5)
    assert row["eval/pass@1"] == pytest.approx(0.5)
    assert row["eval/pass@2"] == pytest.approx(2 / 3)
    # eval results never become trajectories
    marks = ",".join(str(t.task_id) for t in evals)
    assert store.scalar(f"SELECT COUNT(*) FROM trajectories WHERE task_id IN ({marks})") == 0
    assert build_status(store)["policies"][0]["eval"]["pass@2"] == pytest.approx(2 / 3)

    # train step 1 -> version 1 (the last one): its round is leased only to a worker holding version 1
    t = next(t for t in second if not t.sampling)
    assert result(ctl, "w2", t, [1.0, 0.0]) == "accepted"
    batch = ask(ctl, "trainer-main", m.BatchRequest(policy="main", step=1))
    assert isinstance(batch, m.BatchReply) and batch.ready
    pub = m.VersionPublished(policy="main", version=1, step=1, weights_addr="tcp://127.0.0.1:1")
    assert isinstance(ask(ctl, "trainer-main", pub), m.Ack)
    assert ctl.finished() and not ctl.stopping()  # the final round is still to run
    # the trainer is kept (serving version 1's weights) until the final round is done
    held = ask(ctl, "trainer-main", m.BatchRequest(policy="main", step=2))
    assert isinstance(held, m.BatchReply) and not held.done and not held.ready
    assert not [x for x in lease(ctl, "w2", loaded=0) if x.sampling]
    final = lease(ctl, "w2", loaded=1)
    assert len(final) == 3 and all(x.sampling for x in final)
    for x in final:
        result(ctl, "w2", x, [1.0, 1.0], version=1)
    ctl.tick()
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["version"] == 1 and last["eval/pass@1"] == 1.0 and last["eval/version_min"] == 1
    assert ctl.stopping()
    done = ask(ctl, "trainer-main", m.BatchRequest(policy="main", step=2))
    assert isinstance(done, m.BatchReply) and done.done

    # a restarted controller neither repeats nor loses a round
    store.close()
    store2 = Store.open(tmp_path / "state.db")
    ctl2 = Controller(_recipe(tiny_model), tmp_path, store2)
    ctl2.start()
    assert ctl2.evals is not None and not ctl2.evals.pending()
    assert store2.scalar("SELECT COUNT(*) FROM eval_rounds WHERE status = 'done'") == 2


def test_up_prints_eval_rows_as_their_own_line() -> None:
    from astraflow.launch.progress import progress_line

    row = {"kind": "eval", "policy": "main", "version": 3, "step": 3, "eval/avg@4": 0.5, "eval/pass@1": 0.25}
    assert progress_line(row, {"main": 10}) == "[main] eval of version 3  avg@4 0.500  pass@1 0.250"

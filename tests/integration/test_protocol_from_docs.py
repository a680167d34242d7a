"""docs/protocol.md is enough to write a member: a RaaS and a trainer written from the doc alone
(tests/raw_member.py: pyzmq, a msgpack codec and the standard library, nothing of astraflow) run a
real `astraflow controller` process to the end of its budget on loopback, and a RaaS does the same
with CURVE keys made as docs/operations.md says. astraflow itself is used only to start the
controller, to make keys and to read the run afterwards (`astraflow status --json`, docs/status.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from tests.ports import free_port
from tests.raw_member import Curve, RawMember, Seq, pack, packed_episode, samples, task_results

STEPS, GROUP, PROMPTS, SLOTS = 2, 2, 2, 4
RECIPE = f"""
[run]
name = "from-docs"
seed = 0
steps = {STEPS}

[[policy]]
name = "main"
model = "no-model-here"
group_size = {GROUP}
batch_prompts = {PROMPTS}
max_staleness = 1

[workflow]
name = "quickstart"
options = {{ task = "copy", length = 2 }}
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def astraflow(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "astraflow", *args], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@contextmanager
def controller(tmp: Path, run_dir: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`astraflow controller RECIPE --run-dir RUN --bind tcp://127.0.0.1:PORT` (docs/operations.md),
    its address once it wrote RUN/controller.addr; killed on exit if it is still running."""
    (tmp / "recipe.toml").write_text(RECIPE)
    addr = f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "astraflow", "controller", str(tmp / "recipe.toml")]
    log = open(tmp / "controller.out", "wb")
    proc = subprocess.Popen(
        [*cmd, "--run-dir", str(run_dir), "--bind", addr], env=ENV, cwd=tmp, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 30
        while not (run_dir / "controller.addr").is_file():
            assert proc.poll() is None, (tmp / "controller.out").read_text()
            assert time.monotonic() < deadline, "the controller did not start"
            time.sleep(0.05)
        yield proc, addr
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        log.close()


def sampling_of(welcome: dict[str, Any]) -> dict[str, Any]:
    """The task's sampling settings: the policy's `sampling` from the RaaS's Welcome sections."""
    section = welcome["sections"]["policies"]["main"]["sampling"]
    return {k: section[k] for k in ("temperature", "top_p", "top_k")}


def episodes_for(task: dict[str, Any], version: int, sampling: dict[str, Any]) -> list[list[Seq]]:
    """One episode of one sequence per group member: 2 prompt tokens, 2 generated ones, reward 0 or 1."""
    policy = task["roles"]["actor"]
    return [
        [
            Seq(
                policy=policy,
                role="actor",
                tokens=[1 + task["task_id"] % 50, 2, 10 + i, 3],
                loss_mask=[0, 0, 1, 1],
                logprobs=[0.0, 0.0, -0.5, -0.25],
                versions=[-1, -1, version, version],
                reward=float(i % 2),
                sampling=sampling,
            )
        ]
        for i in range(task["group_sizes"][policy])
    ]


def malformed_input_is_answered(addr: str, ctx: zmq.Context) -> None:
    """Each bad message gets its documented Error ("Decode errors", "Framing", the Hello's
    `protocol_version`), with the request's rid when the bytes were a map with one."""
    probe = RawMember(ctx, addr, "raw-probe")
    try:
        refused = probe.hello("raas", ["main"], slots=1, protocol=9)
        assert refused["type"] == "Error" and refused["code"] == "protocol_version", refused
        assert "10" in refused["message"] and "9" in refused["message"], refused
        probe.send_raw(b"\xc1 not msgpack")
        assert (probe.recv(5) or {}).get("code") == "bad_message"
        probe.send_raw(pack({"type": "NoSuchMessage", "rid": 77}))
        reply = probe.recv(5) or {}
        assert (reply.get("code"), reply.get("rid")) == ("unknown_type", 77), reply
        probe.send_raw(pack({"type": "StatusRequest", "rid": 78, "nonsense": 1}))
        reply = probe.recv(5) or {}
        assert (reply.get("code"), reply.get("rid")) == ("bad_message", 78), reply
        probe.send_raw(b"one", b"two")
        assert (probe.recv(5) or {}).get("code") == "bad_message"
        reply = probe.ask("Heartbeat")  # a member that never joined
        assert reply["code"] == "unknown_member", reply
        assert probe.ask("StatusRequest")["type"] == "StatusReply"  # still up, no Hello needed
    finally:
        probe.close()


def check_batch(batch: list[Any], sent: dict[tuple[int, ...], float]) -> None:
    """Every sample of a BatchReply is a sequence this RaaS sent, byte for byte."""
    assert len(batch) == PROMPTS * GROUP
    assert len({s.traj_id for s in batch}) == len(batch)
    for s in batch:
        assert sent[tuple(s.tokens)] == s.reward
        assert s.loss_mask == [0, 0, 1, 1] and s.logprobs == [0.0, 0.0, -0.5, -0.25]
        assert s.versions[:2] == [-1, -1] and not s.replay
        assert s.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


@dataclass
class Ledger:
    """What the RaaS had accepted: tasks, sequences, and each sequence's reward by its tokens."""

    sent: dict[tuple[int, ...], float] = field(default_factory=dict)
    tasks: int = 0
    seqs: int = 0


def answer(raas: RawMember, grant: dict[str, Any], sampling: dict[str, Any], ledger: Ledger) -> None:
    """Answer every task of a TaskGrant; each result must be acked `accepted`."""
    assert grant["type"] == "TaskGrant" and len(grant["tasks"]) <= SLOTS, grant
    raas.learn(grant)
    tasks = grant["tasks"]
    if not tasks:
        return
    raas.active = [t["task_id"] for t in tasks]
    raas.heartbeat()  # renews the leases it lists
    version = raas.loaded["main"]
    results = [(t, episodes_for(t, version, sampling), {0: {"correct": True}}) for t in tasks]
    for _, episodes, _ in results:
        ledger.sent.update({tuple(s.tokens): s.reward for e in episodes for s in e})
    if ledger.tasks == 0:
        first_results_are_acked_as_the_doc_says(raas, results)
    else:
        acks = raas.ask("TaskResults", **task_results(results))
        assert acks["type"] == "ResultsAck", acks
        assert [(a["task_id"], a["status"]) for a in acks["acks"]] == [(i, "accepted") for i in raas.active]
    ledger.tasks += len(tasks)
    ledger.seqs += sum(len(e) for _, episodes, _ in results for e in episodes)
    raas.active = []


def train(trainer: RawMember, step: int, ledger: Ledger) -> bool:
    """Ask for the step's batch; when it is ready, check it and publish the step's version."""
    reply = trainer.ask("BatchRequest", policy="main", step=step, wait_s=0.5, part=0)
    assert reply["type"] == "BatchReply" and not reply["done"], reply
    if not reply["ready"]:
        return False
    assert (reply["step"], reply["part"], reply["parts"]) == (step, 0, 1), reply
    check_batch(samples(reply["columns"]), ledger.sent)
    published = trainer.ask(
        "VersionPublished",
        policy="main",
        version=step,
        step=step,
        weights_addr="tcp://127.0.0.1:9",  # never dialled by the controller: only relayed to workers
        sha256="",
        nbytes=0,
        metrics={"loss": 0.0},
        offers=[],
    )
    assert published == {"type": "Ack", "rid": published["rid"], "detail": "recorded"}
    return True


def join(raas: RawMember, trainer: RawMember) -> dict[str, Any]:
    """Both members join and beat; returns the RaaS's Welcome."""
    welcome = raas.hello("raas", ["main"], slots=SLOTS)
    assert welcome["type"] == "Welcome", welcome
    assert set(welcome["sections"]) == {"workflow", "roles", "policies", "rollout", "weights", "seed"}
    assert welcome["sections"]["roles"] == {"actor": "main"}
    raas.loaded = {"main": 0}  # the initial weights, version 0
    ack = raas.wait_for(raas.heartbeat())  # the first heartbeat after a Hello is answered
    assert ack["type"] == "HeartbeatAck" and ack["idle_interval_s"] > 0 and not ack["stop"], ack
    joined = trainer.hello("trainer", ["main"])
    assert joined["type"] == "Welcome", joined
    assert {"policy", "budget", "run_name", "seed", "weights", "eval"} <= set(joined["sections"])
    trainer.heartbeat()
    return welcome


def test_raas_and_trainer_written_from_the_doc(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ctx = zmq.Context()
    ledger = Ledger()
    with controller(tmp_path, run_dir) as (proc, addr):
        malformed_input_is_answered(addr, ctx)
        raas, trainer = RawMember(ctx, addr, "raw-raas"), RawMember(ctx, addr, "raw-trainer")
        try:
            sampling = sampling_of(join(raas, trainer))
            step, stop, deadline = 1, False, time.monotonic() + 40
            while step <= STEPS and time.monotonic() < deadline:
                grant = raas.ask("TaskRequest", n=SLOTS, loaded=dict(raas.loaded), wait_s=0.5)
                answer(raas, grant, sampling, ledger)
                stop = stop or grant["stop"]
                step += train(trainer, step, ledger)
            assert step == STEPS + 1, f"only {step - 1} steps trained"
            done = trainer.ask("BatchRequest", policy="main", step=step, wait_s=0.0)
            assert done["type"] == "BatchReply" and done["done"], done
            assert trainer.bye("budget reached")["type"] == "Ack"
            while not stop and time.monotonic() < deadline:  # the run is over: heartbeats say stop
                raas.heartbeat()
                beat = raas.recv(1.0) or {}
                raas.learn(beat)
                stop = beat.get("type") == "HeartbeatAck" and beat["stop"]
            assert stop, "the controller never said stop"
            assert raas.loaded == {"main": STEPS}, raas.loaded
            assert raas.bye("stopped")["type"] == "Ack"
            assert proc.wait(20) == 0, "the controller exits 0 once every member left"
        finally:
            raas.close()
            trainer.close()
            ctx.term()
    status = json.loads(astraflow("status", "--run-dir", str(run_dir), "--json"))
    assert status["tasks"]["done"] == ledger.tasks and status["tasks"]["failed"] == 0, status["tasks"]
    buf = status["buffers"]["main"]
    assert buf["consumed"] == STEPS * PROMPTS * GROUP, buf
    assert buf["buffered"] + buf["consumed"] + buf["expired"] + buf["dropped"] == ledger.seqs, buf
    (policy,) = status["policies"]
    assert (policy["version"], policy["step"], policy["finished"]) == (STEPS, STEPS, True), policy
    members = {m["id"]: m for m in status["members"]}
    assert {m["status"] for m in members.values()} == {"left"}, members
    assert members["raw-raas"]["invalid"] == 0 and members["raw-raas"]["failures"] == 0


def first_results_are_acked_as_the_doc_says(raas: RawMember, results: list[Any]) -> None:
    """Columns that do not fit together are refused whole, nothing stored and the leases kept; then
    the same results, well formed, are accepted, and sent again are duplicates. The last one goes as a
    single TaskResult of PackedEpisodes, the other result message the doc lists."""
    *many, (last, last_episodes, _) = results
    message = task_results(many)
    broken = {**message, "columns": {**message["columns"], "lengths": message["columns"]["lengths"][4:]}}
    refused = raas.ask("TaskResults", **broken)
    assert refused["type"] == "Error" and refused["code"] == "bad_result", refused
    assert refused["message"].startswith("TaskResults columns:") and "nothing stored" in refused["message"]
    acks = raas.ask("TaskResults", **message)
    assert acks["type"] == "ResultsAck", acks
    assert [(a["task_id"], a["status"]) for a in acks["acks"]] == [
        (t["task_id"], "accepted") for t, _, _ in many
    ]
    again = raas.ask("TaskResults", **message)
    assert {a["status"] for a in again["acks"]} == {"duplicate"}, again
    single = raas.ask(
        "TaskResult",
        task_id=last["task_id"],
        epoch=last["epoch"],
        episodes=[packed_episode(e, {"correct": False}) for e in last_episodes],
        error="",
    )
    assert single == {
        "type": "ResultAck",
        "rid": single["rid"],
        "task_id": last["task_id"],
        "status": "accepted",
    }


def test_curve_member_written_from_the_doc(tmp_path: Path) -> None:
    """Keys made and registered as docs/operations.md says; the controller finds RUN/keys by itself."""
    run_dir, mine = tmp_path / "run", tmp_path / "member-keys"
    astraflow("keys", "init", "--keys", str(run_dir / "keys"))
    astraflow("keys", "new", "raw-raas", "--dir", str(mine))
    astraflow(
        "keys",
        "add",
        "raw-raas",
        str(mine / "raw-raas.key"),
        "--keys",
        str(run_dir / "keys"),
        "--role",
        "raas",
    )
    curve = Curve.from_files(mine / "raw-raas.key_secret", run_dir / "keys" / "controller.key")
    ctx = zmq.Context()
    with controller(tmp_path, run_dir) as (proc, addr):
        plain = RawMember(ctx, addr, "raw-raas")  # no key: the handshake fails, nothing comes back
        stranger = RawMember(ctx, addr, "raw-raas", Curve(*zmq.curve_keypair(), server=curve.server))
        raas = RawMember(ctx, addr, "raw-raas", curve)
        try:
            for peer in (plain, stranger):
                try:
                    # its handshake may have failed before this send: then the DEALER has no pipe to
                    # queue on and a blocking send would wait for ever; nothing comes back either way
                    peer.send("StatusRequest", flags=zmq.NOBLOCK)
                except zmq.Again:
                    continue
                assert peer.recv(1.5) is None
            other = raas.ask("Hello", member_id="raw-trainer", role="raas", protocol=10, policies=["main"])
            assert other["type"] == "Error" and other["code"] == "bad_identity", other
            role = raas.ask("Hello", member_id="raw-raas", role="trainer", protocol=10, policies=["main"])
            assert role["type"] == "Error" and role["code"] == "bad_identity", role
            welcome = raas.hello("raas", ["main"], slots=SLOTS)
            assert welcome["type"] == "Welcome", welcome
            raas.loaded = {"main": 0}
            assert raas.wait_for(raas.heartbeat())["type"] == "HeartbeatAck"
            grant = raas.ask("TaskRequest", n=SLOTS, loaded={"main": 0}, wait_s=1.0)
            tasks = grant["tasks"]
            assert tasks, grant
            no_info: dict[int, dict[str, Any]] = {}
            results = [(t, episodes_for(t, 0, sampling_of(welcome)), no_info) for t in tasks]
            acks = raas.ask("TaskResults", **task_results(results))
            assert [a["status"] for a in acks["acks"]] == ["accepted"] * len(tasks), acks
            status = raas.ask("StatusRequest")["status"]
            assert status["tasks"]["done"] == len(tasks)
            assert status["buffers"]["main"]["buffered"] == len(tasks) * GROUP
            assert raas.bye("done")["type"] == "Ack"
            assert proc.poll() is None
        finally:
            for peer in (plain, stranger, raas):
                peer.close()
            ctx.term()


def test_the_member_uses_no_astraflow_code() -> None:
    """The member above is what an outside user could write: it imports nothing of astraflow."""
    import ast

    tree = ast.parse((Path(__file__).parents[1] / "raw_member.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and not [n for n in names if n.split(".")[0] in ("astraflow", "tests")], names

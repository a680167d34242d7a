"""The controller service: one single-threaded loop that owns the run's state and answers every member.

It is the only writer of state.db. Each message is handled in its own transaction, and a reply is
sent only after that transaction committed, so whatever a member was told is on disk. Periodic
work (liveness, lease expiry, refilling the task queue) runs between polls.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from astraflow import log
from astraflow.config.load import role_map
from astraflow.config.recipe import Recipe
from astraflow.dataflow.admission import Admission, PolicyLimits
from astraflow.dataflow.buffer import Buffer
from astraflow.dataflow.ledger import Ledger, TaskRow
from astraflow.dataflow.pipeline import Pipeline
from astraflow.dataflow.source import PromptSource, workflow_epochs
from astraflow.metrics.sinks import Sinks
from astraflow.protocol import messages as m
from astraflow.protocol.codec import DecodeError
from astraflow.state.status import build_status
from astraflow.state.store import Store

_log = log.get("controller")

TICK_S = 0.1
"""Seconds between rounds of periodic work (and the poll timeout)."""
RETRY_S = 0.2
"""retry_after_s told to members when nothing is available yet."""


class Controller:
    """The controller's state and handlers; `serve` runs the loop until stopped or the run ends."""

    def __init__(self, recipe: Recipe, run_dir: Path, store: Store) -> None:
        self.recipe = recipe
        self.run_dir = run_dir
        self.store = store
        rc = recipe.rollout
        self.ledger = Ledger(store, lease_timeout_s=rc.lease_timeout_s, max_attempts=rc.max_attempts)
        self.pipeline = Pipeline(recipe, store)
        self.buffer = Buffer(store, order=self.pipeline.order, replay_count=self.pipeline.replay_count)
        self.admission = Admission(
            store,
            {
                # with replay, a batch consumes only its fresh part: admit for that rate, or work expires
                p.name: PolicyLimits(
                    self.pipeline.fresh_per_batch(p.name, p.batch_prompts * p.group_size), p.max_staleness
                )
                for p in recipe.policy
            },
        )
        self.roles = role_map(recipe)
        self.task_policies = list(dict.fromkeys(self.roles.values()))
        self.group_size = recipe.get_policy(self.task_policies[0]).group_size
        self.source = PromptSource(workflow_epochs(recipe), store)
        self.stop_requested = False
        self.finished_at: float | None = None
        self.rate_hist: dict[str, deque[tuple[float, int]]] = {
            p.name: deque([(time.time(), 0)], maxlen=6) for p in recipe.policy
        }
        self.last_tick = 0.0
        self.sinks = Sinks.from_specs([(s.name, s.options) for s in recipe.metrics.sinks], run_dir)

    # ----- start and stop -----------------------------------------------------------------------

    def start(self) -> None:
        """Record the run (or read it back on restart) and give surviving members a fresh timer."""
        from astraflow.rundir import git_sha

        fresh = self.store.init_run(self.recipe.run.name, self.recipe.model_dump(mode="json"), git_sha())
        with self.store.write() as c:
            for p in self.recipe.policy:
                self.store.ensure_policy(p.name, p.max_staleness)
            # After a restart, members get one timeout to show up again before their leases go back.
            c.execute("UPDATE members SET last_seen = ? WHERE status = 'alive'", (time.time(),))
            self.store.add_event("start" if fresh else "restart", self.recipe.run.name)
        if not fresh:
            _log.info(
                "resumed run %s: %s",
                self.recipe.run.name,
                {p["name"]: p["step"] for p in self.store.policies()},
            )
        self.refill()

    def finished(self) -> bool:
        """True once every policy reached the step budget."""
        return all(p["step"] >= self.recipe.run.steps for p in self.store.policies())

    def versions(self) -> list[m.VersionInfo]:
        """The newest version of each policy that has one."""
        return [
            m.VersionInfo(
                policy=v["policy"],
                version=v["version"],
                weights_addr=v["weights_addr"] or "",
                sha256=v["sha256"] or "",
            )
            for v in self.store.latest_versions()
        ]

    # ----- periodic work ------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """Liveness, lease expiry, queue refill, end-of-run bookkeeping."""
        t = time.time() if now is None else now
        timeout = self.recipe.controller.member_timeout_s
        with self.store.write():
            for mem in self.store.members("alive"):
                if (mem["last_seen"] or 0.0) < t - timeout:
                    self.store.set_member_status(mem["id"], "dead")
                    n = self.ledger.release_member(mem["id"])
                    self.store.add_event(
                        "member_dead",
                        f"{mem['id']} silent {t - (mem['last_seen'] or 0):.1f}s; {n} leases back",
                    )
                    _log.warning(
                        "member %s is dead (silent > %.1fs); %d tasks requeued", mem["id"], timeout, n
                    )
            self.ledger.expire(t)
        self.refill()
        if self.finished_at is None and self.finished():
            self.finished_at = t
            _log.info("every policy reached %d steps; telling members to stop", self.recipe.run.steps)

    def refill(self, limit: int = 1024) -> int:
        """Queue prompts through admission and the curators; returns how many tasks were queued."""
        if self.finished():
            return 0
        n = min(self.admission.tasks_to_admit(self.roles, self.group_size), limit)
        if n <= 0:
            return 0
        groups = self.admission.outstanding_groups()
        queued, offered = 0, 0
        with self.store.write():
            while queued < n and offered < max(4 * n, 64):
                if not self.pipeline.admit(self.task_policies, groups, queued):
                    break
                key, sample = self.source.next()
                offered += 1
                if self.pipeline.submit(key, sample, self.task_policies):
                    self.ledger.enqueue(key, {"key": key, **sample}, self.roles, self.group_size)
                    queued += 1
            self.source.save()
        return queued

    # ----- handlers -----------------------------------------------------------------------------

    def handle(self, ident: bytes, msg: m.Msg | DecodeError) -> m.Msg | None:
        """The reply to one message (None: no reply)."""
        if isinstance(msg, DecodeError):
            return m.Error(rid=msg.rid, code=getattr(msg, "code", "bad_message"), message=str(msg)[:500])
        member_id = ident.decode("utf-8", "replace")
        rid = msg.rid
        if isinstance(msg, m.Hello):
            return self.on_hello(ident, msg)
        if isinstance(msg, m.StatusRequest):
            return m.StatusReply(rid=rid, status=build_status(self.store))
        member = self.store.member(member_id)
        if member is None or member["status"] != "alive":
            return m.Error(
                rid=rid, code="unknown_member", message=f"{member_id!r} has not joined; send Hello"
            )
        # each handler takes the message type it is keyed by
        handler = cast(
            "Callable[[dict[str, Any], Any], m.Msg] | None",
            {
                m.Heartbeat: self.on_heartbeat,
                m.Bye: self.on_bye,
                m.TaskRequest: self.on_task_request,
                m.TaskResult: self.on_task_result,
                m.BatchRequest: self.on_batch_request,
                m.VersionPublished: self.on_version,
            }.get(type(msg)),
        )
        if handler is None:
            return m.Error(
                rid=rid,
                code="unexpected_message",
                message=f"the controller does not take {type(msg).__name__}",
            )
        return handler(member, msg)

    def on_hello(self, ident: bytes, msg: m.Hello) -> m.Msg:
        """Check protocol and identity, register the member, send the recipe and versions."""
        if msg.protocol != m.PROTOCOL_VERSION:
            return m.Error(
                rid=msg.rid,
                code="protocol_version",
                message=f"controller speaks protocol {m.PROTOCOL_VERSION}, member {msg.protocol}; install matching astraflow versions",
            )
        if msg.member_id.encode() != ident:
            return m.Error(
                rid=msg.rid, code="bad_identity", message="member_id must equal the socket identity"
            )
        if msg.role not in ("raas", "trainer", "observer"):
            return m.Error(rid=msg.rid, code="bad_role", message=f"unknown role {msg.role!r}")
        with self.store.write():
            prev = self.store.member(msg.member_id)
            released = 0
            if prev is not None and (prev.get("pid") != msg.pid or prev.get("host") != msg.host):
                # a new process under an old id holds none of the old one's tasks
                released = self.ledger.release_member(msg.member_id)
            self.store.upsert_member(
                msg.member_id,
                msg.role,
                policies=list(msg.policies),
                region=msg.region,
                hardware=msg.hardware,
                slots=msg.slots,
                pid=msg.pid,
                host=msg.host,
            )
            self.store.add_event(
                "member_joined" if prev is None else "member_rejoined",
                f"{msg.member_id} {msg.role}"
                + (f"; {released} leases of its previous process back" if released else ""),
            )
        _log.info("member %s joined as %s (%s)", msg.member_id, msg.role, msg.hardware or "?")
        return m.Welcome(
            rid=msg.rid,
            run_name=self.recipe.run.name,
            recipe=self.recipe.model_dump(mode="json"),
            heartbeat_interval_s=self.recipe.controller.heartbeat_interval_s,
            versions=self.versions(),
        )

    def on_heartbeat(self, member: dict[str, Any], msg: m.Heartbeat) -> m.Msg:
        """Touch the member, renew its leases, tell it the versions and whether to stop."""
        now = time.time()
        with self.store.write():
            slots = msg.busy + msg.free
            self.store.touch_member(
                member["id"], now, dict(msg.loaded) if msg.loaded else None, slots if slots > 0 else None
            )
            self.ledger.renew(member["id"], now)
        return m.HeartbeatAck(rid=msg.rid, versions=self.versions(), stop=self.finished())

    def on_bye(self, member: dict[str, Any], msg: m.Bye) -> m.Msg:
        """Return the member's leases at once and mark it left."""
        with self.store.write():
            n = self.ledger.release_member(member["id"])
            self.store.set_member_status(member["id"], "left")
            self.store.add_event("member_left", f"{member['id']} ({msg.reason}); {n} leases back")
        _log.info("member %s left (%s); %d tasks requeued", member["id"], msg.reason or "-", n)
        return m.Ack(rid=msg.rid)

    def on_task_request(self, member: dict[str, Any], msg: m.TaskRequest) -> m.Msg:
        """Lease up to n admitted tasks the member can serve (credit-based flow control)."""
        if self.finished():
            return m.TaskGrant(rid=msg.rid, stop=True, versions=self.versions())
        now = time.time()
        serves = set(member["policies"])
        loaded = dict(msg.loaded)

        def accept(task: TaskRow) -> bool:
            pols = task.policies
            return (not serves or serves.issuperset(pols)) and self.admission.may_lease(
                loaded, pols, Admission.sequences_per_task(task.roles, task.group_size)
            )

        self.refill()
        with self.store.write():
            self.store.touch_member(member["id"], now, loaded or None)
            leased = self.ledger.lease(member["id"], max(0, min(msg.n, 1024)), now, accept)
        tasks = [
            m.Task(task_id=t.id, epoch=t.epoch, sample=t.sample, group_size=t.group_size, roles=t.roles)
            for t in leased
        ]
        return m.TaskGrant(
            rid=msg.rid, tasks=tasks, versions=self.versions(), retry_after_s=0.0 if tasks else RETRY_S
        )

    def on_task_result(self, member: dict[str, Any], msg: m.TaskResult) -> m.Msg:
        """Validate the lease; store trajectories, advantages and filter outcomes durably; then ack."""
        if msg.error:
            status = self.ledger.fail(msg.task_id, msg.epoch, member["id"], msg.error)
            _log.warning("task %d failed on %s: %s (%s)", msg.task_id, member["id"], msg.error[:200], status)
            return m.ResultAck(
                rid=msg.rid,
                task_id=msg.task_id,
                status="failed" if status in ("requeued", "failed") else status,
            )
        bad = _malformed(msg.episodes)
        if bad:
            status = self.ledger.fail(msg.task_id, msg.epoch, member["id"], f"malformed result: {bad}")
            return m.Error(rid=msg.rid, code="bad_result", message=f"task {msg.task_id}: {bad} ({status})")
        with self.store.write():
            status = self.ledger.complete(msg.task_id, msg.epoch, member["id"])
            if status == "accepted":
                task = self.ledger.get(msg.task_id)
                assert task is not None
                self.pipeline.ingest(self.buffer, task.id, task.prompt_key, msg.episodes)
        return m.ResultAck(rid=msg.rid, task_id=msg.task_id, status=status)

    def on_batch_request(self, member: dict[str, Any], msg: m.BatchRequest) -> m.Msg:
        """The recorded batch of the step, a new one, not ready yet, or done."""
        try:
            pol = self.recipe.get_policy(msg.policy)
        except KeyError:
            return m.Error(
                rid=msg.rid, code="unknown_policy", message=f"no policy {msg.policy!r} in this run"
            )
        if msg.step < 1:
            return m.Error(rid=msg.rid, code="bad_request", message="steps are numbered from 1")
        if msg.step > self.recipe.run.steps:
            return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, done=True)
        version = int(self.store.policy(msg.policy)["version"])
        batch = self.buffer.next_batch(
            msg.policy, msg.step, pol.batch_prompts * pol.group_size, pol.max_staleness, version
        )
        if batch is None:
            self.refill()
            return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, retry_after_s=RETRY_S)
        if batch.new:
            self.pipeline.on_batch(msg.policy, sum(1 for s in batch.samples if s.replay))
        return m.BatchReply(rid=msg.rid, policy=msg.policy, step=msg.step, samples=batch.samples, ready=True)

    def on_version(self, member: dict[str, Any], msg: m.VersionPublished) -> m.Msg:
        """Record the version and step, write the step's metrics, tell the curators; then ack."""
        if msg.policy not in self.pipeline.policies:
            return m.Error(
                rid=msg.rid, code="unknown_policy", message=f"no policy {msg.policy!r} in this run"
            )
        now = time.time()
        with self.store.write():
            new = self.store.record_version(
                msg.policy, msg.version, msg.step, msg.weights_addr, msg.sha256, msg.nbytes
            )
            row: dict[str, Any] | None = None
            if new:
                row = self.step_metrics(msg, now)
                self.store.add_metrics(
                    msg.policy, msg.step, {k: v for k, v in row.items() if isinstance(v, int | float)}, now
                )
                self.pipeline.on_version(msg.policy, msg.version)
        if row is not None:
            self.sinks.write(row)
        return m.Ack(rid=msg.rid, detail="recorded" if new else "known")

    def step_metrics(self, msg: m.VersionPublished, now: float) -> dict[str, Any]:
        """The metrics row of a finished step: batch reward and staleness, pipeline counters, trainer metrics."""
        rec = self.buffer.recorded(msg.policy, msg.step)
        rows = self.store.query(
            "SELECT version FROM batches WHERE policy = ? AND step = ?", (msg.policy, msg.step)
        )
        ref = int(rows[0]["version"]) if rows else msg.version - 1
        fresh_ids = [s.traj_id for s in rec.samples if not s.replay] if rec else []
        rewards: list[float] = []
        stale: list[int] = []
        if fresh_ids:
            marks = ",".join("?" for _ in fresh_ids)
            for r in self.store.query(
                f"SELECT reward, min_version FROM trajectories WHERE id IN ({marks})", tuple(fresh_ids)
            ):
                rewards.append(float(r["reward"]))
                stale.append(ref - int(r["min_version"]))
        counts = self.buffer.counts(msg.policy)
        tasks = self.ledger.counts()
        generated = int(
            self.store.scalar("SELECT COUNT(*) FROM trajectories WHERE policy = ?", (msg.policy,))
        )
        hist = self.rate_hist.setdefault(msg.policy, deque(maxlen=6))
        hist.append((now, generated))
        t0, g0 = hist[0]
        rate = (generated - g0) / (now - t0) if now > t0 else 0.0
        row: dict[str, Any] = {k: float(v) for k, v in msg.metrics.items()}
        row.update(self.pipeline.metrics(msg.policy))
        row.update(
            {
                "policy": msg.policy,
                "step": msg.step,
                "version": msg.version,
                "time": now,
                "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
                "samples_per_s": rate,
                "samples_generated": generated,
                "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
                "staleness_max": float(max(stale)) if stale else 0.0,
                "expired": counts["expired"],
                "dropped": counts["dropped"],
                "buffered": counts["buffered"],
                **{f"tasks_{k}": v for k, v in tasks.items()},
            }
        )
        return row

    # ----- the loop -----------------------------------------------------------------------------

    def should_exit(self, now: float) -> bool:
        """After the run's end: once every member left, or after a grace period."""
        if self.finished_at is None:
            return False
        if not self.store.members("alive"):
            return True
        grace = max(10.0, 4 * self.recipe.controller.member_timeout_s)
        return now - self.finished_at > grace

    def serve(self, server: Any) -> int:
        """Poll, dispatch, do periodic work; returns 0 on a signal or at the run's end."""
        while not self.stop_requested:
            for ident, msg in server.poll(int(TICK_S * 1000)):
                try:
                    reply = self.handle(ident, msg)
                except Exception as exc:  # a bad request must never take the controller down
                    _log.exception("handling %s from %r failed", type(msg).__name__, ident)
                    reply = m.Error(rid=getattr(msg, "rid", 0), code="internal", message=str(exc)[:500])
                if reply is not None:
                    server.send(ident, reply)
            now = time.time()
            if now - self.last_tick >= TICK_S:
                self.last_tick = now
                self.tick(now)
                if self.should_exit(now):
                    _log.info("run finished; exiting")
                    break
        self.pipeline.save()
        self.sinks.close()
        return 0


def _malformed(episodes: list[m.Episode]) -> str:
    """Why a result's sequences are inconsistent ('' when they are fine)."""
    for i, ep in enumerate(episodes):
        for j, s in enumerate(ep.sequences):
            n = len(s.tokens)
            if not (len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n):
                return f"episode {i} sequence {j}: tokens/loss_mask/logprobs/versions lengths differ"
    return ""


def run_controller(recipe: Recipe, run_dir: Path, bind: str | None = None) -> int:
    """Run the controller on `run_dir` (resuming its state.db) until SIGTERM/SIGINT or the run's end."""
    from astraflow.transport.server import RouterServer

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    store = Store.open(run_dir / "state.db", synchronous=recipe.controller.synchronous)
    server = None
    try:
        ctl = Controller(recipe, run_dir, store)
        ctl.start()
        server = RouterServer(
            bind or recipe.controller.bind, max_message_bytes=recipe.controller.max_message_bytes
        )

        def on_signal(signum: int, _frame: Any) -> None:
            ctl.stop_requested = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        tmp = run_dir / "controller.addr.tmp"
        tmp.write_text(server.address + "\n")
        tmp.replace(run_dir / "controller.addr")
        _log.info("controller of run %s listening on %s", recipe.run.name, server.address)
        return ctl.serve(server)
    finally:
        if server is not None:
            server.close()
        store.close()

"""`astraflow bench control --in-process`: the controller's CPU per sequence, with no sockets.

One `Controller` on a real state.db is driven through `Controller.dispatch` with the messages the
bench's simulated members send (bench/control_sim.py): two RaaS members ask for a step's tasks (32
in the default `Shape`) at a time and answer each grant in one TaskResults of trivial one-sequence
episodes, one trainer takes each batch and announces the next version. Every message the controller
receives is encoded and decoded as on the wire, and every reply it sends is encoded, so the timed
part is the controller's own work per message minus only ZeroMQ. The members' work (building and
encoding their messages, decoding replies) runs outside the timed part. With `profile` the timed
part (and only it: not the members' work) runs under cProfile and the top functions by own time are
reported, so where a sequence's CPU goes can be compared between builds on a loaded machine (process
CPU time, not wall time).
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from astraflow.bench.control import POLICY, recipe
from astraflow.bench.control_recipe import Shape
from astraflow.bench.sim_results import episodes
from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.protocol.codec import decode, encode
from astraflow.state import trajectories

WORKERS = ("sim-00000", "sim-00001")
TRAINER = "trainer-main"


class _Driver:
    """The controller and the timed path every message takes through it."""

    def __init__(
        self, run_dir: Path, keep_steps: int = 0, shape: Shape = Shape(), archiver: str = "inline"
    ) -> None:
        from astraflow.roles.controller import Controller
        from astraflow.roles.controller.process import settle_heap
        from astraflow.state.store import Store

        rec = Recipe.model_validate(recipe(0.5, len(WORKERS), keep_steps, shape=shape, archiver=archiver))
        self.slots = shape.request
        """Tasks each worker asks for at a time."""
        self.batch = shape.batch_prompts * shape.group_size
        """Sequences a batch takes."""
        self.answered = 0
        """Sequences the workers' accepted results brought, and (`taken`) the batches took."""
        self.taken = 0
        self.ctl = Controller(rec, run_dir, Store.open(run_dir / "state.db"))
        self.ctl.start()
        settle_heap()  # as run_controller does: this process is the controller's for the bench's run
        self.cpu = 0.0
        self.messages = 0
        self.by_type: dict[str, float] = {}
        """Message type -> controller CPU seconds spent on messages of that type."""
        self.prof: cProfile.Profile | None = None
        """Profiles the timed part of every message when set (the members' work stays out of it)."""

    def send(self, ident: str, msg: m.Msg) -> list[m.Msg]:
        """One member message through decode, dispatch and reply encoding; the replies for `ident`."""
        frame = encode(msg)
        if self.prof is not None:
            self.prof.enable()
        t0 = time.process_time()
        out = self.ctl.dispatch(ident.encode(), decode(frame))
        frames = [(who, encode(reply)) for who, reply in out]
        took = time.process_time() - t0
        if self.prof is not None:
            self.prof.disable()
        self.cpu += took
        self.messages += 1
        kind = type(msg).__name__
        self.by_type[kind] = self.by_type.get(kind, 0.0) + took
        return [decode(f) for who, f in frames if who == ident.encode()]


def _hello(d: _Driver, ident: str, role: str) -> None:
    hello = m.Hello(
        member_id=ident,
        role=role,
        protocol=m.PROTOCOL_VERSION,
        policies=[POLICY],
        slots=d.slots,
        pid=1,
        host=f"sim-{ident}",
        hardware="simulated",
    )
    reply = d.send(ident, hello)
    if not isinstance(reply[0], m.Welcome):
        raise RuntimeError(f"{ident} was not welcomed: {reply[0]}")


def _step(d: _Driver, step: int, rng: random.Random, tokens: int) -> int:
    """Workers answer grants until the batch of `step` is ready; the trainer takes it and publishes.
    The trainer asks once the sequences answered since the last batch fill one (or no worker got a
    task in a round): a live trainer's request is held until then, and a held request costs no
    attempt (a worker asking for fewer tasks than a step's would otherwise add the trainer's
    refused attempts to every round)."""
    version = step - 1
    while True:
        leased = 0
        for ident in WORKERS:
            replies = d.send(ident, m.TaskRequest(n=d.slots, loaded={POLICY: version}, wait_s=0.0))
            grant = replies[0]
            if not isinstance(grant, m.TaskGrant) or not grant.tasks:
                continue
            outcomes = [
                m.Outcome(
                    task_id=t.task_id,
                    epoch=t.epoch,
                    episodes=episodes(t, POLICY, version, rng, tokens),
                )
                for t in grant.tasks
            ]
            leased += len(grant.tasks)
            for ack in d.send(ident, m.TaskResults.of(outcomes)):
                if isinstance(ack, m.ResultsAck) and any(a.status != "accepted" for a in ack.acks):
                    raise RuntimeError(
                        f"results refused: {[a for a in ack.acks if a.status != 'accepted'][:2]}"
                    )
                if isinstance(ack, m.ResultsAck):
                    d.answered += sum(len(e.sequences) for o in outcomes for e in o.episodes)
        if leased and d.answered - d.taken < d.batch:
            continue
        reply = d.send(TRAINER, m.BatchRequest(policy=POLICY, step=step, wait_s=0.0))[0]
        if isinstance(reply, m.BatchReply) and reply.ready:
            break
    d.taken += reply.columns.count
    d.send(TRAINER, m.VersionPublished(policy=POLICY, version=step, step=step, weights_addr=""))
    return reply.columns.count


def join(d: _Driver) -> None:
    """The trainer and the workers say Hello."""
    _hello(d, TRAINER, "trainer")
    for ident in WORKERS:
        _hello(d, ident, "raas")


def run_steps(d: _Driver, first: int, n: int, rng: random.Random, tokens: int) -> int:
    """Steps first .. first + n - 1; the sequences their batches carried."""
    return sum(_step(d, s, rng, tokens) for s in range(first, first + n))


def run(
    *,
    steps: int = 20,
    warmup_steps: int = 3,
    tokens: int = 3,
    keep_steps: int = 0,
    profile: bool = False,
    top: int = 25,
    shape: Shape = Shape(),
    archiver: str = "inline",
) -> dict[str, Any]:
    """Drive one controller through `warmup_steps` + `steps` steps; CPU per sequence over `steps`.
    `keep_steps` > 0 turns retention on (an archiving pass every 10 steps, in `VersionPublished`; with
    `archiver` "process" its reading half runs in an archiver process, whose CPU is not counted)."""
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="astraflow-ctl-inproc-") as tmp:
        try:
            d = _Driver(Path(tmp), keep_steps, shape, archiver)
            join(d)
            run_steps(d, 1, warmup_steps, rng, tokens)
            d.cpu, d.messages, d.by_type = 0.0, 0, {}
            # process CPU time, as the figures: wall time on a shared machine counts the waits for a core
            prof = d.prof = cProfile.Profile(time.process_time) if profile else None
            seqs = run_steps(d, warmup_steps + 1, steps, rng, tokens)
            d.prof = None
            d.ctl.close_archiver()
            in_db = trajectories.count(d.ctl.store, POLICY)
            d.ctl.store.close()
            sizes = _sizes(Path(tmp))
        finally:
            gc.unfreeze()  # what settle_heap froze: this process may go on (a test), the controller's is done
    out: dict[str, Any] = {
        "steps": steps,
        "group_size": shape.group_size,
        "batch_prompts": shape.batch_prompts,
        "tokens": tokens,
        "keep_steps": keep_steps,
        "archiver": archiver if keep_steps else None,
        "trajectories_in_db": in_db,
        **sizes,
        "sequences": seqs,
        "messages": d.messages,
        "controller_cpu_s": round(d.cpu, 4),
        "us_per_sequence": round(1e6 * d.cpu / max(1, seqs), 2),
        "ms_per_step": round(1e3 * d.cpu / max(1, steps), 2),
        "sequences_per_cpu_s": round(seqs / d.cpu, 0) if d.cpu else None,
        "us_per_sequence_by_message": {
            k: round(1e6 * v / max(1, seqs), 2) for k, v in sorted(d.by_type.items(), key=lambda kv: -kv[1])
        },
    }
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        out["profile"] = buf.getvalue()
    return out


def _sizes(run_dir: Path) -> dict[str, float]:
    """state.db (with its WAL) and the archive's Parquet files at the run's end, in MB."""
    archive = run_dir / "archive"
    parquet = archive.glob("*.parquet") if archive.is_dir() else []
    return {
        "state_db_mb": round(sum(f.stat().st_size for f in run_dir.glob("state.db*")) / 2**20, 2),
        "archive_mb": round(sum(f.stat().st_size for f in parquet) / 2**20, 2),
    }


def render(r: dict[str, Any]) -> str:
    """The result as lines for a terminal (profile, when taken, after the figures)."""
    lines = [
        f"in-process controller, {r['steps']} steps of {r['sequences'] // max(1, r['steps'])} sequences "
        f"({r['batch_prompts']} tasks x {r['group_size']}), "
        f"{r['tokens']} generated tokens each, {r['messages']} messages"
        + (
            f", retention keeping {r['keep_steps']} steps ({r.get('archiver') or 'inline'} archiver)"
            if r.get("keep_steps")
            else ""
        ),
        f"controller CPU: {r['us_per_sequence']:.1f} us/sequence, {r['ms_per_step']:.1f} ms/step, "
        f"{r['sequences_per_cpu_s']:.0f} sequences per CPU second",
        "  by message: "
        + ", ".join(f"{k} {v:.1f}" for k, v in r["us_per_sequence_by_message"].items())
        + " (us/sequence)",
        f"at the end: state.db {r['state_db_mb']:.1f} MB holding {r['trajectories_in_db']:,} trajectories, "
        f"archive {r['archive_mb']:.1f} MB",
    ]
    if "profile" in r:
        lines.append(r["profile"])
    return "\n".join(lines)

"""What a trainer receives does not depend on how state.db lays out a trajectory: a controller driven
through `Controller.dispatch` with results of sequences of different lengths, logprobs, versions and
sampling settings serves batches (new, replayed, and re-served from state.db by a controller reopened
on the same run directory) whose encoded `BatchReply` bytes hash to the digest recorded from the
layout before token arrays moved to a table of their own (main 9e68a28). Since protocol 10 a batch
travels as columns: the samples the trainer cuts from them are encoded as protocol 9's per-sample
`BatchReply` (`_Protocol9Reply`) and must hash to the same digest. A change to what a TrainSample
carries, or to its order, fails here."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import msgspec

from astraflow.bench.control import POLICY, recipe
from astraflow.config.recipe import Recipe
from astraflow.protocol import messages as m
from astraflow.protocol.codec import decode, encode

DIGEST = "197099912e41a831a95b1254a04ab8bae84de8ac9ddec20c66153c6eb782ce8a"
"""sha256 of every served BatchReply's encoding, in order, on main 9e68a28 (the layout before)."""
WORKER, TRAINER = "raas-0", "trainer-0"


class _Protocol9Reply(msgspec.Struct, tag="BatchReply", tag_field="type", kw_only=True):
    """BatchReply as protocol 9 carried it: one TrainSample struct per sample."""

    rid: int = 0
    policy: str
    step: int
    samples: list[m.TrainSample] = []
    ready: bool = False
    done: bool = False
    retry_after_s: float = 0.0
    part: int = 0
    parts: int = 1


STEPS = 4


def _recipe() -> Recipe:
    raw = recipe(0.5, 1)
    raw["policy"][0].update(
        {
            "group_size": 4,
            "batch_prompts": 3,
            "max_staleness": 2,
            "data": [{"name": "replay", "options": {"ratio": 0.4}}],
            "sampling": {"overrides": {"top_k": True}},
        }
    )
    return Recipe.model_validate(raw)


def _episodes(task: m.Task, version: int, rng: random.Random) -> list[m.PackedEpisode]:
    """The task's group, each sequence with its own length, tokens, logprobs and sampling settings."""
    out = []
    for k in range(task.group_size):
        prompt, gen = rng.randint(1, 5), rng.randint(1, 9)
        settings = m.SamplingParams(temperature=0.5 + 0.25 * (k % 3), top_p=0.9, top_k=k % 2 * 7)
        seq = m.Sequence(
            policy=POLICY,
            tokens=[rng.randint(0, 50_000) for _ in range(prompt + gen)],
            loss_mask=[0] * prompt + [1] * gen,
            logprobs=[0.0] * prompt + [-rng.random() * 4 for _ in range(gen)],
            versions=[-1] * prompt + [max(0, version - rng.randint(0, 1))] * gen,
            reward=float(rng.random() < 0.5),
            sampling=settings,
        )
        out.append(m.PackedEpisode(sequences=[m.PackedSequence.of(seq)]))
    return out


def _send(ctl: object, ident: str, msg: m.Msg) -> list[m.Msg]:
    out = ctl.dispatch(ident.encode(), decode(encode(msg)))  # type: ignore[attr-defined]
    return [reply for who, reply in out if who == ident.encode()]


def _controller(run_dir: Path) -> object:
    from astraflow.roles.controller import Controller
    from astraflow.state.store import Store

    ctl = Controller(_recipe(), run_dir, Store.open(run_dir / "state.db"))
    ctl.start()
    for ident, role in ((TRAINER, "trainer"), (WORKER, "raas")):
        hello = m.Hello(
            member_id=ident,
            role=role,
            protocol=m.PROTOCOL_VERSION,
            policies=[POLICY],
            slots=8,
            pid=1,
            host="h",
        )
        assert isinstance(_send(ctl, ident, hello)[0], m.Welcome)
    return ctl


def _batch(ctl: object, step: int) -> bytes | None:
    """The step's reply as the trainer reads it (decoded, its samples cut from the columns), encoded
    as protocol 9 sent it."""
    (reply,) = _send(ctl, TRAINER, m.BatchRequest(policy=POLICY, step=step, wait_s=0.0))
    assert isinstance(reply, m.BatchReply)
    if not reply.ready:
        return None
    got = decode(encode(reply))
    assert isinstance(got, m.BatchReply)
    fields = {
        f: getattr(got, f)
        for f in ("rid", "policy", "step", "ready", "done", "retry_after_s", "part", "parts")
    }
    return msgspec.msgpack.encode(_Protocol9Reply(samples=got.samples, **fields))


def test_served_batches_are_the_bytes_served_before(tmp_path: Path) -> None:
    rng = random.Random(19)
    ctl = _controller(tmp_path)
    served: list[bytes] = []
    for step in range(1, STEPS + 1):
        version = step - 1
        while (got := _batch(ctl, step)) is None:
            (grant,) = _send(ctl, WORKER, m.TaskRequest(n=8, loaded={POLICY: version}, wait_s=0.0))
            assert isinstance(grant, m.TaskGrant) and grant.tasks
            outcomes = [
                m.Outcome(task_id=t.task_id, epoch=t.epoch, episodes=_episodes(t, version, rng))
                for t in grant.tasks
            ]
            (ack,) = _send(ctl, WORKER, m.TaskResults.of(outcomes))
            assert isinstance(ack, m.ResultsAck) and all(a.status == "accepted" for a in ack.acks)
        served.append(got)
        _send(ctl, TRAINER, m.VersionPublished(policy=POLICY, version=step, step=step, weights_addr=""))
    ctl.store.close()  # type: ignore[attr-defined]
    again = _controller(tmp_path)  # nothing in memory: every batch is read back from state.db
    assert [_batch(again, step) for step in range(1, STEPS + 1)] == served
    again.store.close()  # type: ignore[attr-defined]
    replayed = [
        s for b in served for s in msgspec.msgpack.decode(b, type=_Protocol9Reply).samples if s.replay
    ]
    assert replayed and len({len(s.tokens) for s in replayed}) > 1
    assert hashlib.sha256(b"".join(served)).hexdigest() == DIGEST

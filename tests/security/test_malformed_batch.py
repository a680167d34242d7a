"""A controller (or whatever answers at its address) that sends a trainer a batch whose columns do not
add up: a trainer's real MemberClient asks a ROUTER on loopback for a step's batch in two parts, the
second one forged; the trainer's reader (roles/trainer_batches.py) refuses it with the reason before
it cuts any sample, instead of training on bytes read past one sample's end."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import zmq

from astraflow.errors import AstraflowError
from astraflow.protocol import messages as m
from astraflow.protocol import sample_columns as sc
from astraflow.roles.trainer_batches import fetch_parts
from astraflow.transport.client import MemberClient
from tests.loopback_member import member_of, serve_router


def _samples(n: int) -> list[m.TrainSample]:
    return [
        m.TrainSample(
            traj_id=i,
            tokens=[i] * (i + 2),
            loss_mask=[0] + [1] * (i + 1),
            logprobs=[0.0] + [-0.5] * (i + 1),
            versions=[-1] + [0] * (i + 1),
            reward=float(i % 2),
            advantage=0.5 - i % 2,
            sampling=m.SamplingParams(temperature=0.7),
        )
        for i in range(n)
    ]


@dataclass
class RogueController:
    """A ROUTER that welcomes a trainer and answers part 0 of a batch well and part 1 with `forged`."""

    sock: zmq.Socket
    forged: m.SampleColumns
    good: m.SampleColumns
    stop: threading.Event = field(default_factory=threading.Event)

    def serve(self) -> None:
        serve_router(self.sock, self.stop, self.reply)

    def reply(self, msg: m.Msg) -> m.Msg:
        if isinstance(msg, m.Hello):
            return m.Welcome(rid=msg.rid, run_name="r", sections={}, heartbeat_interval_s=0.5)
        if isinstance(msg, m.Heartbeat):
            return m.HeartbeatAck(rid=msg.rid)
        if isinstance(msg, m.BatchRequest):
            cols = self.good if msg.part == 0 else self.forged
            return m.BatchReply(
                rid=msg.rid,
                policy=msg.policy,
                step=msg.step,
                columns=cols,
                ready=True,
                part=msg.part,
                parts=2,
            )
        return m.Ack(rid=msg.rid)


@pytest.fixture()
def rogue() -> Iterator[tuple[RogueController, MemberClient]]:
    good = sc.pack(_samples(3))
    hello = m.Hello(member_id="trainer-main", role="trainer", protocol=m.PROTOCOL_VERSION, policies=["main"])
    with member_of(lambda router: RogueController(router, forged=good, good=good), hello, 0.5) as (
        ctl,
        client,
        _,
    ):
        yield ctl, client


def _fetch(ctl: RogueController, client: MemberClient, forged: m.SampleColumns) -> list[m.TrainSample] | None:
    ctl.forged = forged
    first = client.request(m.BatchRequest(policy="main", step=1), timeout_s=5.0)
    assert isinstance(first, m.BatchReply) and first.parts == 2
    return fetch_parts(client, first)


def test_a_batch_whose_columns_do_not_add_up_is_refused_with_the_reason(
    rogue: tuple[RogueController, MemberClient],
) -> None:
    ctl, client = rogue
    good = ctl.good
    assert _fetch(ctl, client, good) == _samples(3) * 2  # the reader works: both parts, cut
    lengths = np.frombuffer(good.lengths, "<i4").tolist()
    # one sample claims 50 more tokens than the columns hold: cut as told, it would take its
    # neighbours' tokens (or bytes past the end)
    longer = msgspec.structs.replace(good, lengths=np.array([lengths[0] + 50, *lengths[1:]], "<i4").tobytes())
    with pytest.raises(AstraflowError, match=r"part 1 of batch 1 malformed: batch columns: tokens chunk 0"):
        _fetch(ctl, client, longer)
    # a negative length that keeps the sum right would shift every later sample's bytes
    shifted = np.array([lengths[0] + lengths[1] + 1, -1, *lengths[2:]], "<i4").tobytes()
    with pytest.raises(AstraflowError, match="a sample's length is negative"):
        _fetch(ctl, client, msgspec.structs.replace(good, lengths=shifted))
    # more ids than samples: per-sample columns of different counts
    with pytest.raises(AstraflowError, match="lengths is 12 bytes for 4 samples"):
        _fetch(ctl, client, msgspec.structs.replace(good, traj_ids=good.traj_ids + bytes(8)))
    # sampling settings for fewer samples than there are
    with pytest.raises(AstraflowError, match="sampling_runs add up to 1, not the 3 samples"):
        _fetch(ctl, client, msgspec.structs.replace(good, sampling_runs=np.array([1], "<i4").tobytes()))

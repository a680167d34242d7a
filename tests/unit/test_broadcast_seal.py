"""The broadcast's seal: a member whose collectives "complete" without their bytes (what NCCL does with
work an abort ended) must refuse the message. NCCL cannot run here, so a stand-in process group plays
the aborted communicator (a fake, named so); the real gloo path is in tests/integration."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from astraflow.weights.broadcast import _bcast_all


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


class _FakeGroup:
    """A stand-in process group of rank `rank`: `deliver` copies what rank 0 sent into the buffer,
    otherwise the work completes and the buffer keeps what it held (an aborted NCCL collective)."""

    def __init__(self, rank: int, sent: list[torch.Tensor] | None, deliver: bool) -> None:
        self._rank, self._sent, self._deliver, self.calls = rank, sent, deliver, 0

    def rank(self) -> int:
        return self._rank

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Done:
        if self._deliver and self._sent is not None:
            tensors[0].copy_(self._sent[self.calls])
        self.calls += 1
        return _Done()


def _sent(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """What rank 0 puts on the wire: the chunks, then the seal."""
    sender = _Recorder()
    _bcast_all(sender, chunks, 5.0)
    return sender.seen


class _Recorder(_FakeGroup):
    def __init__(self) -> None:
        super().__init__(0, None, False)
        self.seen: list[torch.Tensor] = []

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Done:
        self.seen.append(tensors[0].clone())
        return _Done()


def test_a_member_takes_a_message_whose_seal_arrived() -> None:
    chunks = [torch.arange(8, dtype=torch.uint8), torch.arange(4, dtype=torch.uint8)]
    wire = _sent(chunks)
    assert len(wire) == 3  # the chunks and the seal
    got = [torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)]
    _bcast_all(_FakeGroup(1, wire, deliver=True), got, 5.0)
    assert all(torch.equal(a, b) for a, b in zip(got, chunks, strict=True))


def test_a_member_refuses_a_message_cut_short_by_an_abort() -> None:
    chunks = [torch.arange(8, dtype=torch.uint8)]
    wire = _sent(chunks)
    got = [torch.zeros(8, dtype=torch.uint8)]
    with pytest.raises(RuntimeError, match="cut short"):
        _bcast_all(_FakeGroup(1, wire, deliver=False), got, 5.0)


def test_a_seal_for_another_number_of_chunks_is_refused() -> None:
    wire = _sent([torch.zeros(2, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8)])
    got = [torch.zeros(2, dtype=torch.uint8)]
    # a member that posted one chunk where the sender sent two gets the seal of two: refused
    with pytest.raises(RuntimeError, match="cut short"):
        _bcast_all(_FakeGroup(1, [wire[0], wire[2]], deliver=True), got, 5.0)

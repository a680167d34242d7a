"""A batch as columns (protocol/sample_columns.py): samples packed into a SampleColumns come back cut
as the very same TrainSamples, through the codec, from any part of the batch; blocks of stored
groups join into the same columns as their samples packed one by one; and columns whose layout does
not add up are refused with the reason, never cut."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

from astraflow.protocol import messages as m
from astraflow.protocol import sample_columns as sc
from astraflow.protocol.codec import decode, encode


def _samples(n: int, seed: int = 3) -> list[m.TrainSample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(0, 9)
        out.append(
            m.TrainSample(
                traj_id=1000 + 3 * i,
                tokens=[rng.randint(0, 2**31 - 1) for _ in range(k)],
                loss_mask=[rng.randint(0, 1) for _ in range(k)],
                logprobs=[-rng.random() for _ in range(k)],
                versions=[rng.randint(-1, 5) for _ in range(k)],
                reward=rng.random() - 0.5,
                advantage=rng.gauss(0.0, 1e3),
                sampling=m.SamplingParams(
                    temperature=(0.5, 1.0, 0.7)[i // 4 % 3], top_p=0.9, top_k=i // 4 % 2
                ),
                replay=rng.random() < 0.3,
            )
        )
    return out


def test_columns_cut_back_into_the_same_samples_through_the_codec_and_in_any_part() -> None:
    samples = _samples(23)
    cols = sc.pack(samples)
    assert cols.count == 23 and len(cols.samplings) == 6  # runs of equal settings, not one each
    reply = decode(encode(m.BatchReply(policy="p", step=1, columns=cols, ready=True)))
    assert isinstance(reply, m.BatchReply) and reply.samples == samples
    for a in range(24):
        for b in range(a, 24):
            part = sc.part(cols, a, b)
            assert not sc.problem(part) and sc.cut(part) == samples[a:b], (a, b)
    # parts of a batch of several chunks
    blocks = [sc.Block.of_samples(samples[k : k + 5]) for k in range(0, 23, 5)]
    chunked = sc.join(
        [(b, 0, len(b)) for b in blocks], [s.traj_id for s in samples], [s.replay for s in samples]
    )
    assert len(chunked.tokens) == 5 and sc.cut(chunked) == samples
    for a in range(24):
        for b in range(a, 24):
            part = sc.part(chunked, a, b)
            assert not sc.problem(part) and sc.cut(part) == samples[a:b], (a, b)
    assert sc.cut(sc.SampleColumns()) == [] and sc.pack([]) == sc.SampleColumns()


def test_blocks_join_into_the_columns_of_their_samples() -> None:
    samples = _samples(12)
    left, right = sc.Block.of_samples(samples[:7]), sc.Block.of_samples(samples[7:])
    # a batch of runs from two blocks, out of their order
    segments = [(right, 2, 5), (left, 0, 3), (right, 0, 2), (left, 3, 7)]
    order = [*samples[9:12], *samples[0:3], *samples[7:9], *samples[3:7]]
    cols = sc.join(segments, [s.traj_id for s in order], [s.replay for s in order])
    assert sc.cut(cols) == order and np.frombuffer(cols.chunks, "<i4").tolist() == [3, 3, 2, 4]
    # through the codec the chunks' views become bytes: the same samples
    reply = decode(encode(m.BatchReply(policy="p", step=1, columns=cols, ready=True)))
    assert isinstance(reply, m.BatchReply) and reply.samples == order
    assert [len(c) for c in reply.columns.loss_mask] == [
        sum(s.length for s in order[a:b]) for a, b in ((0, 3), (3, 6), (6, 8), (8, 12))
    ]


def test_served_advantages_replace_the_column_and_nothing_else() -> None:
    samples = _samples(5)
    cols = sc.with_advantages(sc.pack(samples), [0.25 * k for k in range(5)])
    got = sc.cut(cols)
    assert [s.advantage for s in got] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [msgspec.structs.replace(s, advantage=0.0) for s in got] == [
        msgspec.structs.replace(s, advantage=0.0) for s in samples
    ]
    assert sc.replayed(cols) == sum(s.replay for s in samples)
    assert sc.id_list(cols) == [s.traj_id for s in samples]
    assert sc.length_list(cols) == [s.length for s in samples]
    assert sc.token_count(cols) == sum(s.length for s in samples)


def ints(values: list[int]) -> bytes:
    return np.array(values, "<i4").tobytes()


def _bad(**changes: object) -> str:
    cols = msgspec.structs.replace(sc.pack(_samples(6)), **changes)
    # the codec carries them (a peer can send them): the reader must refuse them
    got = decode(encode(m.BatchReply(policy="p", step=1, columns=cols, ready=True)))
    assert isinstance(got, m.BatchReply)
    why = sc.problem(got.columns)
    with pytest.raises(ValueError, match="batch columns: "):
        sc.cut(got.columns)
    return why


def test_columns_that_do_not_add_up_are_refused_with_the_reason() -> None:
    good = sc.pack(_samples(6))
    lengths = sc.length_list(good)
    longer = ints([lengths[0] + 1, *lengths[1:]])
    assert _bad(lengths=longer).startswith("tokens chunk 0 is")
    negative = ints([-lengths[1] - 1, lengths[0] + 2 * lengths[1] + 1, *lengths[2:]])
    assert _bad(lengths=negative) == "a sample's length is negative"
    assert _bad(traj_ids=good.traj_ids + b"\0") == "traj_ids is 49 bytes, not a whole number of int64"
    assert _bad(traj_ids=good.traj_ids + bytes(8)).startswith("lengths is 24 bytes for 7 samples")
    assert _bad(rewards=good.rewards[:-8]).startswith("rewards is 40 bytes for 6 samples")
    assert _bad(advantages=good.advantages + bytes(8)).startswith("advantages is 56 bytes")
    assert _bad(replay=b"\x00\x01\x02\x00\x00\x00") == "replay holds a value other than 0 or 1"
    assert _bad(loss_mask=[good.loss_mask[0][:-1]]).startswith("loss_mask chunk 0 is")
    assert _bad(sampling_runs=ints([6] * len(good.samplings))).startswith("sampling_runs add up to")
    runs = np.frombuffer(good.sampling_runs, "<i4").tolist()
    assert _bad(sampling_runs=ints([-1, runs[0] + runs[1] + 1, *runs[2:]])) == "a sampling run is negative"
    assert _bad(sampling_runs=good.sampling_runs[:-4]).startswith("sampling_runs is")
    assert _bad(chunks=ints([7])) == "chunks add up to 7 samples, not the 6 there are"
    assert _bad(chunks=ints([-1, 7])).startswith("a chunk's sample count is negative")
    two = ints([2, 4])  # the same bytes said to be two chunks: the lists hold one
    assert _bad(chunks=two) == "tokens/loss_mask/logprobs/versions hold 1/1/1/1 chunks, not the 2 of `chunks`"
    halves = {
        f: [getattr(good, f)[0][:8], getattr(good, f)[0][8:]] for f in ("tokens", "logprobs", "versions")
    }
    why = _bad(chunks=two, loss_mask=[good.loss_mask[0][:2], good.loss_mask[0][2:]], **halves)
    assert why.startswith("tokens chunk 0 is 8 bytes for") and "(the sum of its lengths)" in why
    cold = [msgspec.structs.replace(good.samplings[0], temperature=0.0), *good.samplings[1:]]
    assert _bad(samplings=cold).startswith("sampling settings: temperature 0.0")

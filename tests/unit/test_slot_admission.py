"""When the embedded engine admits queued requests (engines/slot_admission.py): the rule by itself, then the
engine under it with both decode loops. A streaming workload (groups of one prompt queued as others
finish, more than max_batch in all) completes with fewer prefill forwards per row than the greedy rule
gives in the same test; a group is not split when it can wait; a group that cannot fit is admitted
within the wait bound and a request behind it is not held up; and a request's completion (tokens,
logprobs, versions) is the same whenever it is admitted. Real random-init Qwen3 models on CPU."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from astraflow.engines.base import Completion, GenerationRequest
from astraflow.engines.runners import HFRecomputeRunner
from astraflow.engines.slot_admission import SlotAdmission, runs
from astraflow.engines.torch_engine import TorchEngine, TorchEngineConfig
from astraflow.models.init import init_model
from astraflow.protocol.messages import SamplingParams

torch.set_num_threads(1)

LOOPS = ["sync", "overlap"]


# ----- the rule alone ---------------------------------------------------------------------------


@dataclass
class Q:
    run: int


def _queue(*sizes: int) -> list[Q]:
    """Runs of the given sizes, in order."""
    return [Q(i) for i, n in enumerate(sizes) for _ in range(n)]


def test_the_rule_takes_whole_groups_and_waits_rather_than_split_one() -> None:
    q = _queue(8, 8)
    rule = SlotAdmission(max_batch=32, min_free=4, max_wait=10)
    assert rule.pick(q, free=7, running=25) == []  # the first group does not fit: it waits
    assert rule.pick(q, free=12, running=20) == list(range(8))  # one whole group, not 12 rows
    assert rule.pick(q, free=3, running=29) == []  # under min_free
    assert rule.pick(_queue(2), free=3, running=29) == [0, 1]  # everything queued fits
    # idle: greedy at once, even if that splits a group
    assert rule.pick(q, free=12, running=0) == list(range(12))
    # min_free 0 is the greedy rule: every free slot, in queue order
    greedy = SlotAdmission(max_batch=32, min_free=0, max_wait=10)
    assert greedy.pick(q, free=3, running=29) == [0, 1, 2]


def test_the_rule_lets_a_small_group_pass_a_big_one_until_the_big_one_waited_too_long() -> None:
    q = _queue(16, 1, 3)
    rule = SlotAdmission(max_batch=32, min_free=4, max_wait=3)
    # the big group does not fit; the two behind it do, in queue order
    assert rule.pick(q, free=5, running=27) == [16, 17, 18, 19]
    assert rule.pick(q, free=2, running=30) == []  # under min_free, the front passed over again
    assert rule.pick(q, free=0, running=32) == []  # no free slot: not counted
    assert rule.pick(q, free=4, running=28) == [16, 17, 18, 19]
    # passed over three times with slots free: the front is admitted into whatever is free, split
    assert rule.pick(q, free=5, running=27) == [0, 1, 2, 3, 4]
    # and its count starts again
    assert rule.pick(q, free=5, running=27) == [16, 17, 18, 19]


def test_a_full_engine_does_not_make_the_rule_greedy() -> None:
    # a queue behind a full engine waits for rows to finish: that wait does not count
    rule = SlotAdmission(max_batch=32, min_free=16, max_wait=2)
    q = _queue(8, 8, 8)
    for _ in range(50):
        assert rule.pick(q, free=0, running=32) == []
    assert rule.pick(q, free=8, running=24) == []
    assert rule.pick(q, free=16, running=16) == list(range(16))


def test_a_group_larger_than_the_engine_is_cut_into_engine_sized_runs() -> None:
    assert runs(_queue(5, 2), cap=2) == [(0, 2), (2, 4), (4, 5), (5, 7)]
    rule = SlotAdmission(max_batch=4, min_free=4, max_wait=10)
    assert rule.pick(_queue(10), free=4, running=0) == [0, 1, 2, 3]


# ----- the engine under it ----------------------------------------------------------------------


class RowByRow(HFRecomputeRunner):
    """transformers' forward one row per call: a row's logits depend on its own tokens only, so a
    request's logprobs are bit-identical whatever its batch mates and whenever it is admitted."""

    def _last_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        return torch.cat([super(RowByRow, self)._last_logits([s]) for s in seqs])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("admission") / "m", seed=0)


def _engine(model_dir: Path, loop: str, row_by_row: bool = False, **options: Any) -> TorchEngine:
    config = TorchEngineConfig(batch_wait_s=0.01, decode_loop=loop, **options)
    eng = TorchEngine(str(model_dir), config, seed=0)
    if row_by_row:
        eng._decode.runner = RowByRow(eng.model, config.max_batch)
    return eng


def _groups(n: int, size: int, max_new: int = 12) -> list[list[GenerationRequest]]:
    """`n` GRPO groups of `size` samples of one prompt each; stop tokens end rows at varied lengths."""
    out = []
    for g in range(n):
        prompt = [1, 2 + g % 15, 3 + g % 13, 5 + g % 11]
        out.append(
            [
                GenerationRequest(
                    prompt_ids=prompt,
                    max_new_tokens=max_new,
                    sampling=SamplingParams(temperature=1.2),
                    stop_ids=[4, 7, 11],
                    seed=1000 * g + i,
                )
                for i in range(size)
            ]
        )
    return out


def _stream(
    engine: TorchEngine, groups: list[list[GenerationRequest]], in_flight: int
) -> list[list[Completion]]:
    """Keep `in_flight` groups queued or running, as a RaaS does: each finished group is replaced."""

    async def go() -> list[list[Completion]]:
        results: list[list[Completion]] = [[] for _ in groups]
        todo = iter(enumerate(groups))

        async def caller() -> None:
            for i, g in todo:
                results[i] = await engine.generate(g)

        await asyncio.gather(*(caller() for _ in range(in_flight)))
        return results

    return asyncio.run(go())


def _record_prefills(engine: TorchEngine, into: list[list[list[int]]]) -> None:
    runner = engine._decode.runner
    prefill = runner.prefill

    def recording(prompts: list[list[int]], slots: list[int]) -> Any:
        into.append([list(p) for p in prompts])
        return prefill(prompts, slots)

    runner.prefill = recording


@pytest.mark.parametrize("loop", LOOPS)
def test_a_streaming_workload_completes_with_fewer_prefills_per_row(model_dir: Path, loop: str) -> None:
    groups = _groups(24, 8)
    seen: dict[int, dict[str, Any]] = {}
    for min_free in (0, 16):  # the greedy rule, then the default
        eng = _engine(model_dir, loop, max_batch=32, admit_min_free=min_free)
        try:
            outs = _stream(eng, groups, in_flight=6)  # 48 requests outstanding for 32 slots
            seen[min_free] = eng.stats()
        finally:
            eng.close()
        assert [len(o) for o in outs] == [8] * 24
        assert all(
            1 <= len(c.token_ids) <= 12 and c.finish_reason in ("stop", "length") for o in outs for c in o
        )
        assert {c.finish_reason for o in outs for c in o} == {"stop", "length"}  # rows end at varied steps
    old, new = seen[0], seen[16]
    assert old["admitted_rows"] == new["admitted_rows"] == 24 * 8
    # the greedy rule admits rows as they free, splitting groups and prefilling their prompts again
    assert old["prefill_prompts"] > 24 and old["admissions"] > new["admissions"]
    # the rule prefills each group's prompt once, in fewer forwards per admitted row
    assert new["prefill_prompts"] == 24
    assert new["prefill_forwards"] / new["admitted_rows"] < old["prefill_forwards"] / old["admitted_rows"]


def _group_behind_running_rows(model_dir: Path, loop: str, min_free: int) -> int:
    """Six rows of lengths 20..40 hold six of eight slots; a group of four arrives once they decode.
    How many times the group's prompt was prefilled."""
    eng = _engine(model_dir, loop, max_batch=8, admit_min_free=min_free)
    prefilled: list[list[list[int]]] = []
    _record_prefills(eng, prefilled)
    sizes: list[int] = []
    decode = eng.runner.decode

    def recording(tokens: Any, positions: list[int]) -> Any:
        sizes.append(len(positions))
        return decode(tokens, positions)

    eng.runner.decode = recording
    lengths = [40, 20, 22, 24, 26, 28]
    first = [
        GenerationRequest(prompt_ids=[1, 3 + i], max_new_tokens=n, seed=i) for i, n in enumerate(lengths)
    ]
    group = [GenerationRequest(prompt_ids=[1, 9, 9, 9], max_new_tokens=4, seed=50 + i) for i in range(4)]

    async def go() -> list[Completion]:
        running = asyncio.ensure_future(eng.generate(first))
        while not sizes:
            await asyncio.sleep(0.001)
        out = await eng.generate(group)
        await running
        return out

    try:
        outs = asyncio.run(go())
    finally:
        eng.close()
    assert all(len(c.token_ids) == 4 for c in outs)
    assert sizes[0] == 6 and max(sizes) <= 8
    return sum(p.count([1, 9, 9, 9]) for p in prefilled)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_group_that_can_wait_is_not_split(model_dir: Path, loop: str) -> None:
    # greedy: two of the group enter the two free slots at once, the rest later (prefilled again)
    assert _group_behind_running_rows(model_dir, loop, min_free=0) > 1
    # the rule: the whole group waits for four free slots and is prefilled once
    assert _group_behind_running_rows(model_dir, loop, min_free=1) == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_a_group_that_never_fits_is_admitted_within_the_bound_and_does_not_hold_up_others(
    model_dir: Path, loop: str
) -> None:
    eng = _engine(model_dir, loop, max_batch=8, admit_min_free=2, admit_max_wait=4)
    steps: list[int] = []
    admitted_at: dict[tuple[int, ...], int] = {}
    prefill, decode = eng.runner.prefill, eng.runner.decode

    def rec_prefill(prompts: list[list[int]], slots: list[int]) -> Any:
        for p in prompts:
            admitted_at.setdefault(tuple(p), len(steps))
        return prefill(prompts, slots)

    def rec_decode(tokens: Any, positions: list[int]) -> Any:
        steps.append(len(positions))
        return decode(tokens, positions)

    eng.runner.prefill, eng.runner.decode = rec_prefill, rec_decode
    # six rows of 40 tokens leave two slots free for 40 steps; a group of four cannot fit until then
    hold = [GenerationRequest(prompt_ids=[1, 3 + i], max_new_tokens=40, seed=i) for i in range(6)]
    big = [GenerationRequest(prompt_ids=[1, 9, 9, 9], max_new_tokens=3, seed=20 + i) for i in range(4)]
    small = [GenerationRequest(prompt_ids=[1, 8, 8], max_new_tokens=3, seed=30)]

    async def go() -> tuple[int, list[Completion], list[Completion]]:
        running = asyncio.ensure_future(eng.generate(hold))
        while not steps:
            await asyncio.sleep(0.001)
        queued_at = len(steps)
        a = asyncio.ensure_future(eng.generate(big))
        b = asyncio.ensure_future(eng.generate(small))
        out_big, out_small = await a, await b
        await running
        return queued_at, out_big, out_small

    try:
        queued_at, out_big, out_small = asyncio.run(go())
    finally:
        eng.close()
    assert all(len(c.token_ids) == 3 for c in out_big + out_small)
    # the small request passes the big group at once (two free slots, min_free 2) ...
    assert admitted_at[(1, 8, 8)] <= queued_at + 2
    # ... and the big group is admitted (split) within its bound, not when the 40-token rows end
    assert admitted_at[(1, 9, 9, 9)] <= queued_at + 4 + 3
    assert len(steps) >= 39  # the held rows decoded 39 steps after their prefill


@pytest.mark.parametrize("loop", LOOPS)
def test_completions_do_not_depend_on_when_a_request_is_admitted(model_dir: Path, loop: str) -> None:
    groups = _groups(8, 4, max_new=8)
    alone = _engine(model_dir, loop, row_by_row=True, max_batch=8)
    try:
        want = [[asyncio.run(alone.generate([r]))[0] for r in g] for g in groups]
    finally:
        alone.close()
    for min_free in (0, 4):
        eng = _engine(model_dir, loop, row_by_row=True, max_batch=8, admit_min_free=min_free)
        try:
            got = _stream(eng, groups, in_flight=3)
            stats = eng.stats()
        finally:
            eng.close()
        assert stats["admissions"] > 1 and stats["admitted_rows"] == 32  # admitted over time, not at once
        for g_want, g_got in zip(want, got, strict=True):
            for w, c in zip(g_want, g_got, strict=True):
                assert (c.token_ids, c.logprobs, c.versions, c.finish_reason) == (
                    w.token_ids,
                    w.logprobs,
                    w.versions,
                    w.finish_reason,
                )


def test_an_unseeded_request_samples_the_same_whenever_it_is_admitted(model_dir: Path) -> None:
    # The engine draws an unseeded request's seed when it is queued. Queued behind two running rows,
    # a group of three that does not fit is passed by the single request behind it; each must still
    # sample what it samples when all four are admitted at once into an idle engine of the same seed.
    group = [GenerationRequest(prompt_ids=[1, 5, 6], max_new_tokens=6) for _ in range(3)]
    single = GenerationRequest(prompt_ids=[1, 12], max_new_tokens=6)
    hold = [GenerationRequest(prompt_ids=[1, 3 + i], max_new_tokens=20, seed=i) for i in range(2)]
    idle = _engine(model_dir, "sync", row_by_row=True, max_batch=4)
    try:
        want = asyncio.run(idle.generate([*group, single]))
    finally:
        idle.close()
    eng = _engine(model_dir, "sync", row_by_row=True, max_batch=4, admit_min_free=1)
    prefilled: list[list[list[int]]] = []
    _record_prefills(eng, prefilled)

    async def go() -> list[Completion]:
        running = asyncio.ensure_future(eng.generate(hold))
        while not prefilled:
            await asyncio.sleep(0.001)
        out = await eng.generate([*group, single])
        await running
        return out

    try:
        got = asyncio.run(go())
    finally:
        eng.close()
    order = [p for call in prefilled for p in call]
    assert order.index([1, 12]) < order.index([1, 5, 6])  # the single request was admitted first
    assert len({tuple(c.token_ids) for c in want[:3]}) > 1  # the group's samples differ
    for w, c in zip(want, got, strict=True):
        assert (c.token_ids, c.logprobs, c.versions) == (w.token_ids, w.logprobs, w.versions)

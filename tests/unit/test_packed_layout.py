"""A packed sequence's layout check (protocol/packed.py `layout_problem`, protocol/columns.py
`columnable`) takes a short path for whole arrays of bytes: over random sizes and types it gives the
same verdict, word for word, as the check written out field by field."""

from __future__ import annotations

import random

from astraflow.protocol import messages as m
from astraflow.protocol import packed
from astraflow.protocol.columns import columnable, pack

_ITEM = {"tokens": 4, "loss_mask": 1, "logprobs": 4, "versions": 4}


def _reference(fields: dict[str, object]) -> str:
    """The layout rule spelled out: packed bytes of whole items, four arrays of one length."""
    for name, data in fields.items():
        if not isinstance(data, bytes | bytearray | memoryview):
            return f"{name} is {type(data).__name__}, not packed bytes"
        if len(data) % _ITEM[name]:
            return f"{name} is {len(data)} bytes, not a whole number of {_ITEM[name]}-byte items"
    return ""


def _field(rng: random.Random, n: int) -> object:
    kind = rng.choice(["bytes"] * 6 + ["bytearray", "memoryview", "list"])
    raw = bytes(rng.randrange(256) for _ in range(n))
    return {"bytes": raw, "bytearray": bytearray(raw), "memoryview": memoryview(raw), "list": list(raw)}[kind]


def test_the_short_path_gives_the_verdict_of_the_full_check() -> None:
    rng = random.Random(11)
    seen = {"": 0, "bad": 0}
    for _ in range(3000):
        n = rng.randrange(6)
        sizes = {k: v * n + rng.choice([0, 0, 0, 1, 2, 3, 4, -1]) for k, v in _ITEM.items()}
        fields = {k: _field(rng, max(0, s)) for k, s in sizes.items()}
        want = _reference(fields)
        assert packed.layout_problem(*fields.values()) == want  # type: ignore[arg-type]
        seen["" if not want else "bad"] += 1
    assert min(seen.values()) > 200  # both verdicts were exercised


def test_a_result_is_columnable_exactly_when_its_arrays_fit() -> None:
    """Whole arrays of one length are columnable (and pack); a sequence whose arrays differ in
    length, or are not whole items, or are not bytes, is not."""
    rng = random.Random(12)
    for _ in range(500):
        n = rng.randrange(1, 6)
        sizes = {k: v * n + rng.choice([0, 0, 0, 0, 0, 1, -1, 4, -4]) for k, v in _ITEM.items()}
        fields = {k: _field(rng, max(0, s)) for k, s in sizes.items()}
        seq = m.PackedSequence(policy="main", sampling=m.SamplingParams(), **fields)  # type: ignore[arg-type]
        fits = _reference(fields) == "" and (
            len(fields["tokens"])  # type: ignore[arg-type]
            == len(fields["logprobs"])  # type: ignore[arg-type]
            == len(fields["versions"])  # type: ignore[arg-type]
            == 4 * len(fields["loss_mask"])  # type: ignore[arg-type]
        )
        outcome = m.Outcome(task_id=1, epoch=1, episodes=[m.PackedEpisode(sequences=[seq])])
        assert columnable(outcome) == fits
        if fits and all(type(v) is bytes for v in fields.values()):
            assert pack([outcome], checked=True).columns.tokens == fields["tokens"]

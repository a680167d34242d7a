"""The per-token arrays of trajectories, one row per stored group, apart from the trajectory rows.

A group's sequences are stored in one transaction and get consecutive trajectory ids (one writer);
their packed arrays (protocol/packed.py) are joined in id order into one `token_groups` row keyed by
the first id, with each sequence's token count as an int32 array (`lengths`). A trajectory row then
holds only small columns, so what changes or scans trajectories (a batch marking its rows consumed,
reading the buffered rows to order them, status counts) never touches per-token bytes, and a group
costs one row of arrays instead of one per sequence. The row of trajectory i is the one with the
largest first_id <= i; it stays while any of its trajectories is in state.db (state/archive.py
deletes emptied ones). docs/architecture.md, "How far one controller goes".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from astraflow.protocol import packed
from astraflow.state.store import Store

Arrays = tuple[bytes, bytes, bytes, bytes]
"""One sequence's packed (tokens, loss_mask, logprobs, versions)."""
TOKEN_BYTES = sum(packed.ITEM_BYTES.values())
"""Stored bytes per token of the four arrays together."""


def insert_groups(store: Store, rows: Sequence[tuple[Any, ...]]) -> None:
    """Store groups' arrays, one row each (`group_row` or `joined_row`)."""
    with store.write() as c:
        c.executemany(
            "INSERT INTO token_groups (first_id, rows, lengths, tokens, loss_mask, logprobs, versions) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            rows,
        )


def group_row(first_id: int, arrays: Sequence[Arrays]) -> tuple[Any, ...]:
    """The token_groups row of a group: its first trajectory id and its sequences' arrays in id order."""
    tokens, masks, logprobs, versions = zip(*arrays, strict=True)
    return joined_row(
        first_id,
        len(arrays),
        np.fromiter(map(len, masks), packed.INT32, len(arrays)).tobytes(),
        (b"".join(tokens), b"".join(masks), b"".join(logprobs), b"".join(versions)),
    )


def joined_row(first_id: int, rows: int, lengths: bytes, joined: Arrays) -> tuple[Any, ...]:
    """The token_groups row of a group whose sequences' arrays are joined already (a slice of a
    message's columns), with their int32 token counts."""
    return (first_id, rows, lengths, *joined)


def _ids_json(ids: Iterable[int]) -> str:
    return "[" + ",".join(str(int(i)) for i in ids) + "]"


_GROUPS_OF = (
    "SELECT DISTINCT (SELECT first_id FROM token_groups WHERE first_id <= j.value ORDER BY first_id DESC "
    "LIMIT 1) FROM json_each(?) j"
)
"""The first_id of the group of each trajectory id in a JSON array (one index probe per id)."""


def groups_between(store: Store, lo: int, hi: int) -> list[int]:
    """The first ids of the groups that may hold trajectories lo..hi: from the group of lo (the
    largest first_id <= lo) to hi, by the key."""
    return [
        int(r[0])
        for r in store.conn.execute(
            "SELECT first_id FROM token_groups WHERE first_id <= ? AND first_id >= COALESCE("
            "(SELECT first_id FROM token_groups WHERE first_id <= ? ORDER BY first_id DESC LIMIT 1), ?)",
            (hi, lo, lo),
        )
    ]


def arrays(store: Store, ids: Iterable[int]) -> dict[int, Arrays]:
    """Trajectory id -> its packed arrays, for these ids (whole groups are read and sliced)."""
    want = set(ids)
    if not want:
        return {}
    rows = store.query(
        "SELECT first_id, rows, lengths, tokens, loss_mask, logprobs, versions FROM token_groups "
        f"WHERE first_id IN ({_GROUPS_OF})",
        (_ids_json(want),),
    )
    out: dict[int, Arrays] = {}
    for r in rows:
        first = int(r[0])
        for k, one in enumerate(split(r[2], r[3], r[4], r[5], r[6])):
            if first + k in want:
                out[first + k] = one
    return out


def split(lengths: bytes, tokens: bytes, mask: bytes, logprobs: bytes, versions: bytes) -> list[Arrays]:
    """A group row's arrays cut back into its sequences' (the bytes each sequence was stored with)."""
    ends = list(accumulate(np.frombuffer(lengths, packed.INT32).tolist()))
    out: list[Arrays] = []
    start = 0
    for end in ends:
        a, b = 4 * start, 4 * end
        out.append((tokens[a:b], mask[start:end], logprobs[a:b], versions[a:b]))
        start = end
    return out


def token_counts(store: Store, ids: Iterable[int]) -> dict[int, int]:
    """Trajectory id -> its token count, read from the groups' lengths without their arrays."""
    want = set(ids)
    if not want:
        return {}
    rows = store.query(
        f"SELECT first_id, lengths FROM token_groups WHERE first_id IN ({_GROUPS_OF})", (_ids_json(want),)
    )
    out: dict[int, int] = {}
    for first, lengths in rows:
        for k, n in enumerate(np.frombuffer(lengths, packed.INT32).tolist()):
            if int(first) + k in want:
                out[int(first) + k] = int(n)
    return out


def delete_emptied(store: Store, first_ids: Iterable[int]) -> int:
    """Delete those of these groups none of whose trajectories is left in state.db; how many."""
    with store.write() as c:
        cur = c.execute(
            "DELETE FROM token_groups WHERE first_id IN (SELECT value FROM json_each(?)) AND NOT EXISTS "
            "(SELECT 1 FROM trajectories t WHERE t.id >= token_groups.first_id "
            "AND t.id < token_groups.first_id + token_groups.rows)",
            (json.dumps(sorted({int(i) for i in first_ids})),),
        )
        return int(cur.rowcount)


def with_arrays(rows: Iterable[Any], found: dict[int, Arrays]) -> list[dict[str, Any]]:
    """Trajectory rows (mappings with an `id`) as dicts with their arrays added under the column names
    they had when they lived in the trajectory row (tokens, loss_mask, logprobs, versions)."""
    out = []
    for r in rows:
        d = dict(r)
        d["tokens"], d["loss_mask"], d["logprobs"], d["versions"] = found[int(d["id"])]
        out.append(d)
    return out

"""A recorded batch split into parts that each fit one BatchReply.

A member drops any message over its 64 MiB limit, so a batch whose samples add up to more is served
in parts: consecutive slices of the recorded composition, each at most `controller.batch_part_bytes`
of samples. The split depends only on the recorded trajectories and that setting, so every request
for part k of a step gets the same slice (also after a controller restart). Ingest refuses any
sequence larger than one part (dataflow/limits.py), so every recorded batch can be delivered.
"""

from __future__ import annotations

from astraflow.dataflow.limits import SAMPLE_OVERHEAD_BYTES


def part_bounds(sizes: list[int], budget: int) -> list[tuple[int, int]]:
    """[start, end) of each part of samples with these encoded sizes, in order, each part's total at
    most `budget` (a sample over the budget alone would still get a part of its own); [(0, 0)] for
    an empty batch."""
    bounds: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, size in enumerate(sizes):
        cost = size + SAMPLE_OVERHEAD_BYTES
        if i > start and used + cost > budget:
            bounds.append((start, i))
            start, used = i, 0
        used += cost
    bounds.append((start, len(sizes)))
    return bounds

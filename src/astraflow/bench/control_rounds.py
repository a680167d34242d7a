"""`bench control`'s rows compared: each row against the first row of its results mode, CURVE setting
and round, and with several rounds each member count's medians (bench/control.py runs the rows)."""

from __future__ import annotations

import statistics
from typing import Any


def compare(rows: list[dict[str, Any]]) -> None:
    """Set each row's `sequences_vs_first` and `rss_kb_per_extra_member` against the first row of the
    same results mode, CURVE setting and round."""
    for key in {(r["results"], r["curve"], r["round"]) for r in rows}:
        base = next(r for r in rows if (r["results"], r["curve"], r["round"]) == key)
        for r in rows:
            if (r["results"], r["curve"], r["round"]) == key:
                r["sequences_vs_first"] = (
                    round(r["sequences_per_s"] / base["sequences_per_s"], 3)
                    if base["sequences_per_s"]
                    else None
                )
                extra = r["members"] - base["members"]
                r["rss_kb_per_extra_member"] = (
                    round(1024 * (r["controller_rss_mb"] - base["controller_rss_mb"]) / extra, 1)
                    if extra
                    else None
                )


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (results mode, CURVE, members): the rounds' median sequences/s and median ratio to the
    first row of the same round, with every round's ratio."""
    out = []
    for key in dict.fromkeys((r["results"], r["curve"], r["members"]) for r in rows):
        same = [r for r in rows if (r["results"], r["curve"], r["members"]) == key]
        ratios = [r["sequences_vs_first"] for r in same if r.get("sequences_vs_first") is not None]
        out.append(
            {
                "results": key[0],
                "curve": key[1],
                "members": key[2],
                "rounds": len(same),
                "sequences_per_s": statistics.median(r["sequences_per_s"] for r in same),
                "ratio_median": round(statistics.median(ratios), 3) if ratios else None,
                "ratios": ratios,
            }
        )
    return out

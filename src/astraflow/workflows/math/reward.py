"""The math reward: the last \\boxed{} of a completion checked against the gold answer by math-verify.

Runs inside VerifierPool workers (math-verify uses sympy, which can take unbounded time).
"""

from __future__ import annotations

from astraflow.workflows.math.data import last_boxed


def boxed_reward(completion: str, gold: str) -> tuple[float, bool]:
    """(1.0 if the last boxed answer equals `gold` mathematically else 0.0, whether a boxed answer exists)."""
    import logging

    from math_verify import parse, verify

    # The pool kills an overrunning worker, so math-verify's own (signal-based) timeouts are off and
    # its warning that they are off would repeat on every call.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    pred = last_boxed(completion)
    if pred is None or not pred.strip():
        return 0.0, False
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return 0.0, True
    return (1.0 if verify(gold_parsed, pred_parsed, timeout_seconds=None) else 0.0), True

"""The streaming rollout benchmark: the embedded engine fed as a RaaS feeds it, under several admission
rules (engine option `admit_min_free`), measured side by side in one run.

A RaaS keeps `slots` tasks in its engine, each one `generate` call of a GRPO group (one prompt,
`group` samples), and sends each finished group's result while the next task takes its place. Here
`in_flight` callers each loop over groups of random prompts until `groups` groups are done, so the
engine's queue holds about `in_flight * group - max_batch` requests behind its running rows. The
callers start `stagger_s` apart, as a RaaS's first tasks arrive one by one: rows that run to their
length then finish a group at a time, a few steps apart, as in a RaaS. Each rule
gets its own engine on one loaded model directory; the rules run in turn, a warm-up round first, then
`repeats` rounds alternating the rules, and the table gives medians.

Per rule: generated tokens per second of wall time; prefill forwards per admitted row and admissions
(EngineStats); the prefill share of the decode thread's busy time; the mean decode batch. Where rows
end at different steps (`stops`: a set of stop tokens, so rows end at random lengths) the greedy rule
admits into every slot as it frees and splits groups across admissions. On a CPU the prefill share is
that of a compute-bound forward; on a GPU an admission's prefill is launch-bound (milliseconds of
host time whatever its size), so the counts carry over and the share does not.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.bench.rollout import check_model_dir
from astraflow.errors import AstraflowError


@dataclass
class StreamRound:
    """One rule's numbers over one stream of `groups` groups."""

    tokens_per_s: float
    forwards_per_row: float
    admissions: int
    prefill_share: float
    mean_batch: float


@dataclass
class StreamBench:
    """What `run_stream_bench` measured, per rule (admit_min_free) in the order given."""

    device: str
    rules: list[int]
    rounds: dict[int, list[StreamRound]]

    def median(self, rule: int, key: str) -> float:
        """The median of one field over the timed rounds of `rule`."""
        return float(statistics.median(getattr(r, key) for r in self.rounds[rule]))


def parse_rules(spec: str) -> list[int]:
    """'0,16,64' -> [0, 16, 64]: distinct admit_min_free values, each >= 0."""
    try:
        rules = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        rules = []
    if not rules or min(rules) < 0 or len(set(rules)) != len(rules):
        raise AstraflowError(f"bad --rules {spec!r}", hint="give distinct integers >= 0, e.g. 0,16,64")
    return rules


def _groups(
    n: int, group: int, prompt_len: int, new_tokens: int, stops: list[int], vocab: int, seed: int
) -> list[Any]:
    from astraflow.engines.base import GenerationRequest

    rng = random.Random(seed)
    out = []
    for g in range(n):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        out.append(
            [
                GenerationRequest(
                    prompt_ids=prompt, max_new_tokens=new_tokens, stop_ids=stops, seed=seed + g * group + i
                )
                for i in range(group)
            ]
        )
    return out


def _stream(engine: Any, groups: list[Any], in_flight: int, stagger_s: float) -> int:
    """Feed `groups` through `in_flight` callers, caller i starting i * stagger_s late; the tokens
    generated."""

    async def go() -> int:
        todo = iter(groups)
        made = 0

        async def caller(i: int) -> None:
            nonlocal made
            await asyncio.sleep(i * stagger_s)
            for g in todo:
                out = await engine.generate(g)  # awaited first: `made +=` reads `made` before an await in it
                made += sum(len(c.token_ids) for c in out)

        await asyncio.gather(*(caller(i) for i in range(in_flight)))
        return made

    return asyncio.run(go())


def _round(engine: Any, groups: list[Any], in_flight: int, stagger_s: float) -> StreamRound:
    before = engine.stats()
    t0 = time.perf_counter()
    tokens = _stream(engine, groups, in_flight, stagger_s)
    wall = time.perf_counter() - t0
    time.sleep(0.05)  # the last pass's counters land after its completions are delivered
    after = engine.stats()

    def grown(key: str) -> float:
        return float(after[key]) - float(before[key])

    return StreamRound(
        tokens_per_s=tokens / wall,
        forwards_per_row=grown("prefill_forwards") / max(grown("admitted_rows"), 1.0),
        admissions=int(grown("admissions")),
        prefill_share=grown("prefill_s") / max(grown("busy_s"), 1e-9),
        mean_batch=grown("row_steps") / max(grown("decode_steps"), 1.0),
    )


def run_stream_bench(
    model_dir: Path,
    rules: list[int],
    *,
    max_batch: int = 64,
    group: int = 16,
    in_flight: int = 8,
    groups: int = 32,
    prompt_len: int = 16,
    new_tokens: int = 64,
    stops: int = 0,
    stagger_s: float = 0.0,
    decode_loop: str = "sync",
    device: str = "auto",
    dtype: str = "float32",
    repeats: int = 3,
    seed: int = 0,
    threads: int = 1,
) -> StreamBench:
    """Stream `groups` GRPO groups through one engine per admission rule (admit_min_free values),
    rounds alternating the rules; `stops`: that many token ids (from 4 up) end a row; `stagger_s`:
    the callers start this far apart, as a RaaS's tasks arrive one by one."""
    check_model_dir(model_dir)
    if not rules or len(set(rules)) != len(rules) or min(rules) < 0:
        raise AstraflowError(f"bad admission rules {rules}", hint="give distinct admit_min_free values >= 0")
    if min(max_batch, group, in_flight, groups, prompt_len, new_tokens, repeats) < 1:
        raise AstraflowError("every size of the streaming bench must be at least 1", hint="see --help")
    import torch

    from astraflow.engines.torch_engine import TorchEngine, TorchEngineConfig

    torch.set_num_threads(threads)
    engines: dict[int, Any] = {}
    try:
        for rule in rules:
            config = TorchEngineConfig(
                max_batch=max_batch,
                dtype=dtype,
                max_seq_len=prompt_len + new_tokens,
                decode_loop=decode_loop,
                admit_min_free=rule,
            )
            engines[rule] = TorchEngine(str(model_dir), config, seed=seed, device=device)
        any_engine = next(iter(engines.values()))
        vocab = int(any_engine.model.config.vocab_size)
        work = _groups(groups, group, prompt_len, new_tokens, list(range(4, 4 + stops)), vocab, seed)
        rounds: dict[int, list[StreamRound]] = {rule: [] for rule in rules}
        for k in range(repeats + 1):
            for rule in rules if k % 2 else rules[::-1]:
                r = _round(engines[rule], work, in_flight, stagger_s)
                if k:  # round 0 warms every engine up
                    rounds[rule].append(r)
        return StreamBench(str(any_engine.device), rules, rounds)
    finally:
        for eng in engines.values():
            eng.close()


def format_stream_table(res: StreamBench) -> str:
    """Medians per rule, with tokens/s as a ratio to the first rule's."""
    base = res.median(res.rules[0], "tokens_per_s")
    lines = [
        f"device {res.device}; medians of {len(next(iter(res.rounds.values())))} rounds per rule",
        f"{'admit_min_free':>14} {'tok/s':>9} {'x first':>8} {'fwd/row':>8} {'admissions':>10} "
        f"{'prefill share':>13} {'mean batch':>10}",
    ]
    for rule in res.rules:
        tps = res.median(rule, "tokens_per_s")
        lines.append(
            f"{rule:>14} {tps:>9.0f} {tps / base:>8.2f} {res.median(rule, 'forwards_per_row'):>8.3f} "
            f"{res.median(rule, 'admissions'):>10.0f} {res.median(rule, 'prefill_share'):>13.1%} "
            f"{res.median(rule, 'mean_batch'):>10.1f}"
        )
    lines.append(
        "prefill share: of the decode thread's busy time; on a CPU a prefill is compute-bound, on a GPU "
        "launch-bound, so compare counts across devices, not shares"
    )
    return "\n".join(lines)

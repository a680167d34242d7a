"""The TrainSamples of just-stored buffered trajectories, kept so the batch that consumes them is
built without reading and decoding them back from state.db (dataflow/buffer.py).

A bounded dict (FRESH_TOKENS tokens in all, oldest dropped first): trajectory id -> the TrainSample
the store would read back, holding the arrays of the decoded result as they were stored. A miss
reads the store. The buffer clears it on a rollback: the ids of a rolled-back insert are reused.
"""

from __future__ import annotations

from functools import lru_cache

from astraflow.protocol.columns import ResultColumns
from astraflow.protocol.messages import PackedSequence, SamplingParams, TrainSample

FRESH_TOKENS = 262_144
"""Tokens of just-stored buffered trajectories kept in memory as ready TrainSamples (tens of MB at
most), so that the batch which consumes them is built without reading and decoding them back."""


class FreshSamples(dict[int, TrainSample]):
    """Trajectory id -> its TrainSample, for buffered trajectories stored lately; `tokens` in all."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0

    def remember(self, ids: list[int], seqs: list[PackedSequence], advantages: list[float]) -> None:
        """Keep stored buffered trajectories as the TrainSamples the store would read back."""
        for i, seq, adv in zip(ids, seqs, advantages, strict=True):
            sp = seq.sampling
            arrays = (seq.tokens, seq.loss_mask, seq.logprobs, seq.versions)
            self._keep(
                i, arrays, seq.reward, adv, sampling(float(sp.temperature), float(sp.top_p), int(sp.top_k))
            )
        self._trim()

    def remember_columns(
        self, ids: list[int], view: ResultColumns, a: int, b: int, advantages: list[float]
    ) -> None:
        """`remember` of the stored sequences a..b-1 of a message's columns: each sample's arrays are
        slices of the message's joined columns, cut at the group's token offsets in one pass."""
        c = view.cols
        kept = [sampling(float(sp.temperature), float(sp.top_p), int(sp.top_k)) for sp in c.samplings]
        tok = view.tok[a : b + 1].tolist()
        tokens, mask, logprobs, versions = c.tokens, c.loss_mask, c.logprobs, c.versions
        self.update(
            (
                i,
                TrainSample(
                    traj_id=i,
                    tokens=tokens[4 * t0 : 4 * t1],
                    loss_mask=mask[t0:t1],
                    logprobs=logprobs[4 * t0 : 4 * t1],
                    versions=versions[4 * t0 : 4 * t1],
                    reward=reward,
                    advantage=float(adv),
                    replay=False,
                    sampling=kept[sp],
                ),
            )
            for i, t0, t1, reward, adv, sp in zip(
                ids,
                tok[:-1],
                tok[1:],
                view.reward_list[a:b],
                advantages,
                view.sampling[a:b].tolist(),
                strict=True,
            )
        )
        self.tokens += tok[-1] - tok[0]
        self._trim()

    def _keep(
        self, i: int, arrays: tuple[bytes, bytes, bytes, bytes], reward: float, adv: float, sp: SamplingParams
    ) -> None:
        """Keep trajectory i: its arrays (tokens, loss mask, logprobs, versions) of the decoded result,
        as stored (bytes: nothing changes them)."""
        tokens, mask, logprobs, versions = arrays
        self[i] = TrainSample(
            traj_id=i,
            tokens=tokens,
            loss_mask=mask,
            logprobs=logprobs,
            versions=versions,
            reward=float(reward),
            advantage=float(adv),
            replay=False,
            sampling=sp,
        )
        self.tokens += len(mask)

    def _trim(self) -> None:
        while self.tokens > FRESH_TOKENS and self:
            self.tokens -= len(self.pop(next(iter(self))).loss_mask)

    def forget(self) -> None:
        """Drop every kept sample."""
        self.clear()
        self.tokens = 0

    def take(self, ids: list[int]) -> dict[int, TrainSample]:
        """Remove and return the kept samples of these ids (those not kept are absent)."""
        out: dict[int, TrainSample] = {}
        for i in ids:
            sample = self.pop(i, None)
            if sample is not None:
                self.tokens -= len(sample.loss_mask)
                out[i] = sample
        return out


@lru_cache(maxsize=64)
def sampling(temperature: float, top_p: float, top_k: int) -> SamplingParams:
    """The (frozen, so shareable) settings of stored samples: a batch has one or a few distinct ones."""
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)

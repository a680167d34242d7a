"""The RolloutEngine contract: generate with per-token logprobs and versions; take new weights
at a safe point between decode steps."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from astraflow.protocol.messages import SamplingParams

if TYPE_CHECKING:
    import torch

    from astraflow.weights.slot_ref import SlotRef


@dataclass
class GenerationRequest:
    """One prompt to complete."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """The distribution to sample from (temperature, top-p, top-k); see engines/sampling.py."""
    stop_ids: list[int] = field(default_factory=list)
    """Generation ends after any of these tokens (the stop token is kept in token_ids)."""
    seed: int | None = None


@dataclass
class Completion:
    """What the engine generated for one request."""

    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each generated token under the tempered sampling distribution."""
    versions: list[int]
    """Weight version that produced each generated token (changes mid-sequence on a weight update)."""
    finish_reason: str
    """stop | length"""
    sampling: SamplingParams
    """The settings the engine actually sampled this completion with (its logprobs are of that
    distribution); the Sequence built from it carries them to the trainer. Required: every engine
    reports what it used, never what it was asked."""


class RolloutEngine(ABC):
    """A generation backend serving one policy inside a RaaS process."""

    Config: Any = None
    """Pydantic model of the engine's options (recipe: policy.engine_options)."""

    @abstractmethod
    async def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Complete every request; concurrent callers are batched together by the engine."""

    async def generate_n(self, request: GenerationRequest, n: int) -> list[Completion]:
        """n samples of one prompt (a GRPO group); with a seed, sample i uses seed + i.

        The default submits n copies in one call; an engine that shares the prompt's prefill
        across the group (vLLM's `n`, SGLang's radix cache) overrides it."""
        reqs = [
            request if request.seed is None else replace(request, seed=request.seed + i) for i in range(n)
        ]
        return await self.generate(reqs)

    @abstractmethod
    def load_weights(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Schedule new weights; they apply between decode steps, so in-flight sequences continue
        under the new version. Thread-safe; returns at once."""

    def load_slot(self, version: int, slot: SlotRef) -> bool:
        """Optionally take a version as a reference to the same-host slot that holds it (the RaaS got
        it by shm or CUDA IPC; weights/slot_ref.py) and map it where the engine's weights live, instead
        of being handed tensors. False (the default): the RaaS calls `load_weights` with the tensors.
        An engine that takes it checks names, shapes and dtypes at once (raising leaves the old weights
        in place), maps and checks the digest itself, and applies between decode steps like
        `load_weights`; the slot stays locked until `version` (or a newer one) is in use. If a check
        fails where it reads the slot, it keeps the old weights and says so through an optional
        `slot_refused(version) -> bool`: the RaaS then fetches the version again and hands it over as
        tensors."""
        return False

    @property
    @abstractmethod
    def version(self) -> int:
        """The weight version decode steps currently use."""

    @abstractmethod
    def capacity(self) -> int:
        """How many sequences the engine decodes together at most."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release resources (threads, devices)."""


class StagedWeights:
    """Weights staged for an engine's own update thread, for engines that apply them outside this
    process's decode loop (the vLLM and SGLang plugins): offered tensors and same-host slots are
    checked against the checkpoint, then staged under `_cond` for the thread, which takes `_staged`,
    applies it and calls `_applied_version`, or raises `_refused` when it could not read a slot.

    Mix in before `RolloutEngine` and call `_init_staging` in `__init__` (after setting `device`)."""

    device: torch.device
    """Where the engine's weights live: the RaaS maps same-host versions there."""

    def _init_staging(self, expected: dict[str, torch.Tensor] | None) -> None:
        """Nothing staged, version 0 in use; `expected` is the checkpoint's meta tensors (None: no
        check, the model is not a local directory)."""
        self._expected = expected
        self._refused = -1
        """The newest version whose slot the update thread could not read."""
        self._version = 0
        self._staged: tuple[int, dict[str, Any] | SlotRef] | None = None
        self._cond = threading.Condition()
        self._applied = threading.Condition(threading.Lock())

    def load_weights(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Check the weights against the checkpoint's names, shapes and dtypes (WeightsMismatchError:
        nothing is staged) and stage them; the update thread applies them between two steps."""
        self._check(state_dict)
        with self._cond:
            staged = self._staged[1] if self._staged is not None else {}
            # a newer version supersedes one not applied yet; partial updates compose
            merged = dict(staged) if isinstance(staged, dict) else {}
            merged.update(state_dict)
            self._staged = (version, merged)
            self._cond.notify()

    def load_slot(self, version: int, slot: SlotRef) -> bool:
        """Take a same-host version by reference: check its layout against the checkpoint (raises
        WeightsMismatchError) and stage it, so only the reference reaches the update thread. False
        (send tensors instead) for a CUDA IPC slot when the engine is not on a GPU."""
        if slot.kind == "cuda_ipc" and self.device.type != "cuda":
            return False
        from astraflow.weights.slot_ref import layout_meta

        self._check(layout_meta(slot))
        with self._cond:
            self._staged = (version, slot)  # a slot holds a whole version: it supersedes what is staged
            self._cond.notify()
        return True

    def slot_refused(self, version: int) -> bool:
        """Whether `version`'s slot could not be read where the engine reads it (and nothing newer
        applied): the RaaS then hands it over as tensors."""
        return self._refused >= version > self._version

    def wait_version(self, version: int, timeout: float | None = None) -> bool:
        """Block until weights of `version` (or newer) are in use; False on timeout."""
        with self._applied:
            return self._applied.wait_for(lambda: self._version >= version, timeout=timeout)

    def _applied_version(self, version: int) -> None:
        """The update thread's word that `version` is in use (wakes `wait_version`)."""
        with self._applied:
            self._version = version
            self._applied.notify_all()

    def _check(self, offered: Mapping[str, Any]) -> None:
        """WeightsMismatchError unless every offered tensor is one of the checkpoint's, with its shape
        and a dtype of its kind (no check when the model is not a local directory)."""
        from astraflow.engines.weights import check_weights

        if self._expected is not None:
            check_weights(self._expected, offered)

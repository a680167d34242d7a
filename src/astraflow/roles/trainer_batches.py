"""A trainer's batch reader: the parts of a step's batch, each BatchReply's columns cut into the
TrainSamples the trainer's step consumes (protocol/sample_columns.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from astraflow.errors import AstraflowError

if TYPE_CHECKING:
    from astraflow.transport.client import MemberClient


def fetch_parts(client: MemberClient, first: Any, stop: Callable[[], bool] | None = None) -> list[Any] | None:
    """The samples of a ready batch: `first`'s, then those of its other parts (a batch larger than one
    message comes in parts), cut from each reply's columns; None when the controller says the run is
    done meanwhile. Columns that do not add up end the trainer with the reason."""
    from astraflow.protocol.messages import BatchReply, BatchRequest
    from astraflow.roles.member import request_retrying

    samples = batch_samples(first)
    for part in range(1, first.parts):
        reply = request_retrying(
            client, BatchRequest(policy=first.policy, step=first.step, part=part), timeout_s=60.0, stop=stop
        )
        if isinstance(reply, BatchReply) and reply.done:
            return None
        if not (isinstance(reply, BatchReply) and reply.ready and reply.part == part):
            detail = f"{reply.code} {reply.message}" if hasattr(reply, "code") else type(reply).__name__
            raise AstraflowError(f"controller refused part {part} of batch {first.step}: {detail}")
        samples += batch_samples(reply)
    return samples


def batch_samples(reply: Any) -> list[Any]:
    """The TrainSamples of one BatchReply, cut from its columns (AstraflowError when they do not add up)."""
    from astraflow.protocol import sample_columns

    try:
        return sample_columns.cut(reply.columns)
    except ValueError as exc:
        raise AstraflowError(
            f"the controller sent part {reply.part} of batch {reply.step} malformed: {exc}",
            hint="the controller and this trainer must run the same astraflow version",
        ) from None

"""Who sent a message: the member a CURVE key was issued to, as the controller's transport knows it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Principal:
    """The authenticated sender of a frame: its key's name, role and (trainers) policy.

    With authentication off the transport yields None instead, and handlers fall back to the
    checks that do not need an identity (next version, next step, slots, lease ownership).
    """

    name: str
    """The member name the key was added under (`astraflow keys add NAME ...`); its member id."""
    role: str
    """raas | trainer | observer."""
    policy: str | None = None
    """The one policy a trainer key may act for; None for other roles."""

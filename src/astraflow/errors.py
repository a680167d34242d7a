"""The one family of user-facing errors; the CLI renders them once, with a hint."""

from __future__ import annotations


class AstraflowError(Exception):
    """An error a user can cause and fix: bad recipe, missing plugin, unreachable controller."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class Stopped(Exception):
    """A wait given up because the process was asked to stop (a signal set its stop flag); not a user
    error: the role that asked to be stoppable catches it and exits with its signal's code."""


class RecipeError(AstraflowError):
    """The recipe does not validate."""


class PluginError(AstraflowError):
    """A plugin is missing, duplicated or broken."""


class ConnectError(AstraflowError):
    """A controller or weight server could not be reached."""


class ProtocolError(AstraflowError):
    """A peer sent something the protocol does not allow."""


class WeightIntegrityError(AstraflowError):
    """Received weights do not match their manifest's sha256."""


class WeightsMismatchError(AstraflowError):
    """Weights offered to an engine do not fit its model (names, shapes or dtypes differ)."""


class EngineFailedError(AstraflowError):
    """A rollout engine's decode loop stopped on an error; the engine serves nothing more."""

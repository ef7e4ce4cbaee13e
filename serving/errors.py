"""What the registry's actions refuse with, in a module of its own: validation, quota counts, rollouts and the
API all raise or catch it, and none of them should have to import the actions (or what they import) to do so."""

from __future__ import annotations

NOT_LOADED = "not loaded: "  # failure_reason of a ready version left unloaded by its tenant's quota


class RegistrationError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

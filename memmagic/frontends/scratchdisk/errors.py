"""What the scratch disk raises when a script does what it cannot keep off the disk."""

from __future__ import annotations

__all__ = ["RefusedCall", "ProgramRefused"]


class RefusedCall(BaseException):
    """The script called something that would change the disk, which the scratch disk
    cannot keep off it; raised before anything changed. A BaseException, so the script's
    own ``except Exception`` does not carry on as if the call had worked."""


class ProgramRefused(FileNotFoundError):
    """A program the script tried to start was not started (it would run outside the
    scratch disk): to the script, as if the program were not installed, which libraries
    that probe for one (``nvidia-smi``, ``git``) handle."""

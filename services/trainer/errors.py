"""Errors the trainer and SFT stop on with one line (``python -m services.trainer: error: ...``)."""

import shutil
from pathlib import Path


class CheckpointWriteError(RuntimeError):
    """A checkpoint or the final model could not be written (a full volume, most often); the message names the
    fix."""


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GB" if n >= 2**30 / 10 else f"{n / 2**20:.1f} MB"


def write_failure(cause: BaseException, where: str | Path) -> str:
    """``(Type: first line of the cause); that filesystem has N free``: writers report a full disk in their own
    words (torch's zip writer as an "unexpected pos" mismatch), so the free space is stated beside them."""
    text = str(cause).strip()
    first = text.splitlines()[0][:300] if text else type(cause).__name__
    try:
        free = f"{size(shutil.disk_usage(where).free)} free"
    except OSError:
        free = "unknown free space"
    return f"({type(cause).__name__}: {first}); that filesystem has {free}"

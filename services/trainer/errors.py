"""Errors the trainer and SFT stop on with one line (``python -m services.trainer: error: ...``)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint or the final model could not be written (a full volume, most often); the message names the
    fix."""

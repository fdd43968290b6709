"""Molt's ``molt.utils.logging_utils`` for agents: ``init_logger``.

``init_logger(name)`` gives the logger Molt's does: its own stdout handler in Molt's format, INFO and above,
not propagated. Nothing is configured at import, so loading an agent leaves the worker's own logging as it
was. Molt's W&B and TensorBoard loggers are the trainer's (importing one says so).
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import NoReturn

from molt.utils import left_out

_FORMAT = "%(levelname)s %(asctime)s %(filename)s:%(lineno)d] %(message)s"
_DATE_FORMAT = "%m-%d %H:%M:%S"


class NewLineFormatter(logging.Formatter):
    """Repeats the line's prefix (level, time, place) on each further line of a multi-line message, so every
    line of the output can be attributed by grep."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        at = text.find(record.message) if record.message else -1
        return text.replace("\n", "\n" + text[:at]) if at > 0 else text


@functools.cache
def _stdout_handler() -> logging.Handler:
    handler = logging.StreamHandler(sys.stdout)
    handler.setLevel(logging.INFO)
    handler.setFormatter(NewLineFormatter(_FORMAT, datefmt=_DATE_FORMAT))
    return handler


def init_logger(name: str) -> logging.Logger:
    """The logger ``name``, printing INFO and above to stdout in Molt's format (DEBUG records still reach
    handlers added to it); it does not propagate, so a worker's root handlers do not print it twice."""
    logger = logging.getLogger(name)
    logger.setLevel(logging.DEBUG)
    logger.addHandler(_stdout_handler())
    logger.propagate = False
    return logger


LEFT_OUT = dict.fromkeys(
    ("WandbLogger", "TensorboardLogger"),
    "the trainer logs the run (--logger.wandb.*, --logger.tensorboard_dir); an agent reports its numbers in "
    "Result.info, which the trainer logs with the rest",
)


def __getattr__(name: str) -> NoReturn:
    left_out(__name__, name, LEFT_OUT)

"""A watchdog for the env worker's event loop: it names the synchronous code that holds it.

Agents' async methods all run on the worker's one event loop: a blocking call in one (``time.sleep``, a busy loop,
a socket read without a timeout, a lock) stops every episode, the probes, the sessions' lease renewals and the
episode deadlines until it returns. A thread watches a heartbeat the loop sets: once it has not run for
``--envs.stall_warn_s``, the thread logs the loop thread's stack from the agent's first frame, the episode that
holds it and the others in flight, and the fix; then a shorter line every ``REPEAT`` x that while it stays stuck,
and one when it runs again. The worker is not dumpable (no py-spy), so this is the one view of such a stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from types import FrameType
from typing import TYPE_CHECKING, Any

import anyio
import fastapi
import starlette
import uvicorn
from prometheus_client import Counter

import molt
import services

if TYPE_CHECKING:
    from services.envs.worker import EpisodeWorker

log = logging.getLogger("molt.envs.watchdog")

REPEAT = 6
"""While the loop stays blocked, a reminder every REPEAT x --envs.stall_warn_s (a minute at the default)."""
HEAD_FRAMES, TAIL_FRAMES = 10, 20
"""A deeper stack is shown as its first and last frames: the agent's own calls, and where it waits."""
MAX_NAMED = 10

FIX = (
    "fix: make the call async (an async client, asyncio.sleep, asyncio.create_subprocess_exec) or run it in a "
    "thread: `result = await asyncio.to_thread(fn, *args)` (CPU-heavy work: a process pool, or "
    "molt.agents.sandbox.run_python)"
)


def _dir(module: Any) -> str:
    return os.path.dirname(module.__file__) + os.sep


# The frames between the loop and the agent's code: a stack is shown from the first frame past them.
_FRAMEWORK = (
    *(_dir(m) for m in (asyncio, molt, services, uvicorn, starlette, fastapi, anyio)),
    contextlib.__file__,
    "<frozen ",
)
_WORKER_FILE = os.path.join(_dir(services), "envs", "worker.py")


def user_frames(frame: FrameType) -> traceback.StackSummary:
    """The stack of ``frame`` (a thread's innermost frame) from the first frame of the user's code on: what the
    worker's episode called into, and everything it called (the stdlib or a library it waits in). A stack that
    holds no user code is kept whole."""
    frames = traceback.extract_stack(frame)  # outermost first
    # Past the worker's own frame (outer ones are the server, or a test runner), else from the start.
    start = max((i + 1 for i, f in enumerate(frames) if f.filename == _WORKER_FILE), default=0)
    user = next((i for i in range(start, len(frames)) if not frames[i].filename.startswith(_FRAMEWORK)), 0)
    return traceback.StackSummary.from_list(frames[user:])


def format_frames(stack: traceback.StackSummary) -> str:
    if len(stack) <= HEAD_FRAMES + TAIL_FRAMES:
        return "".join(stack.format())
    head = traceback.StackSummary.from_list(stack[:HEAD_FRAMES]).format()
    tail = traceback.StackSummary.from_list(stack[-TAIL_FRAMES:]).format()
    return "".join([*head, f"  ... {len(stack) - HEAD_FRAMES - TAIL_FRAMES} more frames ...\n", *tail])


class LoopWatchdog:
    """Started on the worker's loop (``start``), stopped on it (``stop``); ``stalls`` counts stalls by agent."""

    def __init__(self, worker: EpisodeWorker, stall_s: float, stalls: Counter) -> None:
        self.worker = worker
        self.stall_s = stall_s
        self.stalls = stalls
        self.period = min(1.0, stall_s / 4)
        self.beat = time.monotonic()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._handle: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._tick()
        self._thread = threading.Thread(target=self._watch, name="envs-loop-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._thread is not None:
            self._thread.join(5)

    def _tick(self) -> None:
        self.beat = time.monotonic()
        assert self._loop is not None
        self._handle = self._loop.call_later(self.period, self._tick)

    def _watch(self) -> None:
        try:
            self._watch_loop()
        except Exception:  # a bug here must not pass silently, nor touch the worker
            log.exception("the event-loop watchdog stopped")

    def _watch_loop(self) -> None:
        stalled_beat: float | None = None  # the heartbeat the reported stall began after
        holder = ""
        next_report = 0.0
        while not self._stop.wait(self.period):
            beat, now = self.beat, time.monotonic()
            if stalled_beat is not None and beat != stalled_beat:
                log.warning("event loop ran again after about %.1f s blocked (%s)", beat - stalled_beat, holder)
                stalled_beat = None
            if now - beat < self.stall_s:
                continue
            if stalled_beat is None:
                stalled_beat, next_report = beat, now + REPEAT * self.stall_s
                holder, agent = self._report(now - beat)
                self.stalls.labels(agent).inc()
            elif now >= next_report:
                next_report = now + REPEAT * self.stall_s
                stack = self._stack()
                where = (
                    f'now at File "{stack[-1].filename}", line {stack[-1].lineno}, in {stack[-1].name}; '
                    if stack
                    else ""
                )
                log.warning("event loop still blocked after %.0f s (%s); %s%s", now - beat, holder, where, FIX)

    def _stack(self) -> traceback.StackSummary:
        frame = sys._current_frames().get(self._loop_thread)
        return user_frames(frame) if frame is not None else traceback.StackSummary()

    def _report(self, blocked_s: float) -> tuple[str, str]:
        """Log the first warning of a stall; (what holds the loop, for the later lines; its agent, for the metric)."""
        # Read from this thread while the loop thread is stuck: asyncio's table of running tasks, a copy of the
        # worker's episodes (a dict copy is atomic under the GIL).
        task = asyncio.current_task(self._loop)
        running = dict(self.worker.running)
        now = time.monotonic()
        mine = running.get(task) if task is not None else None
        if mine is not None:
            episode, started = mine
            agent = episode.env_name
            holder = f"episode {episode.trajectory_id or '(no session yet)'} of agent {agent!r}"
            detail = f" (group {episode.group_id!r} sample {episode.sample_index}, running {now - started:.1f} s)"
        else:
            agent, detail = "unknown", ""
            holder = "a task that is not an episode's own (one an agent started, or the worker's)"
        others = [
            f"{ep.trajectory_id or '(no session yet)'} ({ep.env_name}, {now - t:.0f} s)"
            for k, (ep, t) in running.items()
            if k is not task
        ]
        waiting = ", ".join(others[:MAX_NAMED]) + (
            f" and {len(others) - MAX_NAMED} more" if len(others) > MAX_NAMED else ""
        )
        log.warning(
            "event loop blocked for %.1f s by synchronous code in %s%s: every episode of this worker, its probes "
            "and its sessions' lease renewals wait until it returns (the gateway closes the sessions once their "
            "lease lapses). It is at (most recent call last):\n%s%s\nepisodes waiting: %s",
            blocked_s,
            holder,
            detail,
            format_frames(self._stack()),
            FIX,
            waiting or "none",
        )
        return holder, agent

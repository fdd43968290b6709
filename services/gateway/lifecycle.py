"""The session lifecycle of a gateway replica: open, look up, renew, abort, finish into the stream, expire;
draining on SIGTERM, parking open sessions for another replica and adopting them (handoff.py). A finish's
trajectory and its write are finish.py's; the turns that run inside a session are the subclass in core.py."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from molt.bus import TrajectoryQueue
from molt.metrics import Metrics
from molt.schema import Trajectory
from services.gateway import sampling
from services.gateway.capture import Capture
from services.gateway.chat import ChatModel, bad_request
from services.gateway.config import GatewaySettings
from services.gateway.errors import GatewayError, UnreadableParkedSession
from services.gateway.finish import build_trajectory, read_outcome, write_batch
from services.gateway.handoff import SessionHandoff
from services.gateway.limits import OpenSessions
from services.gateway.pods import PodPool
from services.gateway.rescore import rescore
from services.gateway.session import CONTEXT_FULL, REPLIES, Session

log = logging.getLogger("molt.gateway")


class SessionLifecycle:
    """The sessions one gateway replica holds, from open to finished (the base of core.Gateway)."""

    def __init__(
        self,
        settings: GatewaySettings,
        model: ChatModel,
        pool: PodPool,
        queue: TrajectoryQueue,
        metrics: Metrics,
        new_session_id: Callable[[], str] = lambda: uuid.uuid4().hex,
        limits: OpenSessions | None = None,
        handoff: SessionHandoff | None = None,
    ) -> None:
        self.settings = settings
        self.new_session_id = new_session_id  # names this replica when there are several (replicas.py)
        self.model = model
        self.pool = pool
        self.queue = queue
        self.metrics = metrics
        self.sessions: dict[str, Session] = {}
        self.num_open = 0
        """Open sessions on this replica (the drain waits for them); per key they are counted in ``limits``."""
        self.limits = limits or OpenSessions(settings.auth.max_open_sessions_per_key)
        """Each API key's open sessions, counted across replicas when they share Redis (limits.py)."""
        self._released: list[tuple[str, str]] = []  # (owner, session id) closed, not yet taken off ``limits``
        self.handoff = handoff
        """Where open sessions are parked when this replica exits and adopted from (handoff.py); None: lost."""
        self._adopting: dict[tuple[str, str | None], asyncio.Future] = {}  # (session id, key): a take
        self._moved_marks: dict[str, float] = {}  # adopted session -> when its moved marker was last written
        scfg = settings.session
        self.default_sampling = {"temperature": scfg.temperature, "top_p": scfg.top_p, "max_tokens": scfg.max_tokens}
        limit = model.max_model_len
        self.default_max_length = min(scfg.max_length, limit) if limit else scfg.max_length
        self.drain_deadline: float | None = None  # monotonic time; set once SIGTERM starts a drain

    # ---- draining (SIGTERM with --session.drain_s)

    def start_draining(self, drain_s: float) -> None:
        self.drain_deadline = time.monotonic() + drain_s
        log.warning("draining: serving %d open sessions for up to %.0f s, no new ones", self.num_open, drain_s)

    def drained(self) -> bool:
        """True once a drain has started and no session is open or its time is up."""
        return self.drain_deadline is not None and (not self.num_open or time.monotonic() >= self.drain_deadline)

    async def shut_down(self) -> int:
        """Close what is still open when the process exits (a drain that ran out of time, or none). With a
        handoff each open session is parked for another replica to adopt (``outcome="handed_off"``; its key's
        slot stays taken: the session is still open). Without one, or when parking fails, they are lost:
        logged, counted as ``outcome="lost"``, and taken off their keys' counts. Returns how many were lost."""
        still_open = [s for s in self.sessions.values() if s.state == "open"]
        lost = still_open
        if still_open and self.handoff is not None:
            lost = await self._park(still_open)
        for s in lost:
            self._close(s, "lost", "lost")
        if lost:
            log.warning(
                "shutting down with %d open sessions: their episodes are lost (nothing written); a longer "
                "--session.drain_s lets them finish",
                len(lost),
            )
        await self.release_closed()
        return len(lost)

    async def _park(self, sessions: list[Session], wait_s: float = 5.0) -> list[Session]:
        """Park ``sessions`` in the handoff; the ones that could not be parked. A session whose turn is still
        running (a streamed turn's task) is waited for up to ``wait_s``, so what is parked holds that turn."""
        deadline = time.monotonic() + wait_s
        taken: list[Session] = []
        left: list[Session] = []
        for s in sessions:
            if s.lock.locked():  # wait_for would time a free lock out too once the deadline has passed
                try:
                    await asyncio.wait_for(s.lock.acquire(), max(0.01, deadline - time.monotonic()))
                except TimeoutError:
                    left.append(s)
                    continue
            else:
                await s.lock.acquire()
            taken.append(s)
        try:
            ready = [s for s in taken if s.state == "open"]
            assert self.handoff is not None
            await self.handoff.park(ready, self.settings.session.idle_ttl_s)
            for s in ready:
                self._close(s, "handed_off", "handed_off", release=False)
            if ready:
                log.warning(
                    "shutting down with %d open sessions: parked in Redis, the next replica they reach "
                    "goes on with them",
                    len(ready),
                )
        except Exception as exc:  # noqa: BLE001 - any Redis failure: the sessions stay on this replica, logged
            log.error("could not park %d open sessions in Redis: %s", len(taken), exc)
            left += taken
        finally:
            for s in taken:
                s.lock.release()
        return [s for s in left if s.state == "open"]

    async def session(self, sid: str, owner: str | None, open_only: bool = True) -> Session:
        """``get_session``, adopting ``sid`` from the handoff when another replica parked it (handoff.py)."""
        if sid not in self.sessions and self.handoff is not None:
            await self.adopt(sid, owner)
        return self.get_session(sid, owner, open_only)

    async def adopt(self, sid: str, owner: str | None) -> bool:
        """Take ``sid`` over from the handoff if it is parked there under ``owner``'s key; True when this replica
        holds it now. Concurrent calls for one id and key share one attempt. Redis down: 503
        ``sessions_unavailable`` (the session may be parked: a 404 would tell the agent it is gone)."""
        pending = self._adopting.get((sid, owner))
        if pending is None:
            pending = self._adopting[(sid, owner)] = asyncio.ensure_future(self._adopt(sid, owner))
            pending.add_done_callback(lambda _: self._adopting.pop((sid, owner), None))
        await asyncio.shield(pending)
        return sid in self.sessions and self.sessions[sid].owner == owner

    async def _adopt(self, sid: str, owner: str | None) -> None:
        assert self.handoff is not None
        try:
            s = await self.handoff.take(sid, owner)
        except UnreadableParkedSession as exc:  # taken off Redis already: said loudly and counted, never a 404
            log.error(
                "session %s was parked by another replica but cannot be read here: %s; its episode is lost", sid, exc
            )
            self.metrics.child("molt_gateway_sessions_total", "lost").inc()
            raise GatewayError(
                500,
                f"session {sid} was parked by a gateway replica this one cannot read ({exc}); "
                "its episode is lost: open a new session",
                code="handoff_unreadable",
            ) from None
        except Exception as exc:  # noqa: BLE001 - any Redis failure is a 503 the client retries
            raise GatewayError(
                503,
                f"cannot look up session {sid} in Redis ({type(exc).__name__}: {exc}); retry shortly",
                code="sessions_unavailable",
                retry_after_s=1,
            ) from None
        if s is None or sid in self.sessions:
            return
        self.sessions[sid] = s
        self.num_open += 1
        self.metrics["molt_gateway_open_sessions"].inc()
        self.metrics["molt_gateway_sessions_adopted_total"].inc()
        if self.handoff.public_url:  # take() wrote its moved marker
            self._moved_marks[sid] = time.monotonic()
        if s.pod is not None and s.pod in self.pool.pods:
            self.pool.get(s.pod).sessions += 1
        if owner is not None:
            try:
                await self.limits.hold(owner, sid)
            except Exception as exc:  # noqa: BLE001 - it is open here either way: counting it must not lose it
                log.warning("session %s adopted but not counted against its key (Redis: %s)", sid, exc)
        log.info("adopted session %s (%d turns) from the replica that held it", sid, s.turns)

    async def locate(self, sid: str, owner: str | None) -> str | None:
        """Where ``sid`` is, once the replica its id names did not answer: ``""`` when this replica holds it
        (adopted from the handoff just now), another replica's URL when that one adopted it, else None."""
        if sid in self.sessions:
            return ""
        if self.handoff is None:
            return None
        if await self.adopt(sid, owner):
            return ""
        try:
            return await self.handoff.moved_to(sid)
        except Exception as exc:  # noqa: BLE001 - any Redis failure: logged, the session counts as not moved
            log.warning("cannot look up where session %s moved (Redis: %s)", sid, exc)
            return None

    @property
    def policy_version(self) -> int:
        return self.pool.policy_version

    # ---- sessions

    async def open_session(self, owner: str | None, body: dict) -> Session:
        if self.drain_deadline is not None:
            raise GatewayError(
                503,
                "this gateway replica is shutting down: open the session again (another replica takes it)",
                code="draining",
                retry_after_s=1,
            )
        sp = sampling.session_params(body.get("sampling_params"), len(self.model.tokenizer))
        max_length = body.get("max_length")
        if max_length is None:
            max_length = self.default_max_length
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= 0:
            raise bad_request(f"'max_length' must be a positive integer, got {max_length!r}", "max_length")
        limit = self.model.max_model_len
        if limit and max_length > limit:
            raise bad_request(f"'max_length' {max_length} is over the model's {limit} positions", "max_length")
        # A null field is an absent one, as on the model wires (clients serialising a dataclass send nulls).
        sample_index = 0 if body.get("sample_index") is None else body["sample_index"]
        if not isinstance(sample_index, int) or isinstance(sample_index, bool) or sample_index < 0:
            raise bad_request(f"'sample_index' must be an integer >= 0, got {sample_index!r}", "sample_index")
        if not isinstance(body.get("metadata") or {}, dict):
            raise bad_request("'metadata' must be an object", "metadata")
        for key in ("group_id", "env_name", "env_version"):
            if body.get(key) is not None and not isinstance(body[key], (str, int)):
                raise bad_request(f"'{key}' must be a string", key)
        lease_s = body.get("lease_s")
        if lease_s is not None and (
            isinstance(lease_s, bool)
            or not isinstance(lease_s, (int, float))
            or not 1 <= lease_s <= self.settings.session.idle_ttl_s
        ):
            raise bad_request(
                f"'lease_s' must be a number of seconds in [1, {self.settings.session.idle_ttl_s:g}] "
                f"(--session.idle_ttl_s), got {lease_s!r}",
                "lease_s",
            )
        context_full = "error" if body.get("context_full") is None else body["context_full"]
        if context_full not in CONTEXT_FULL:
            raise bad_request(
                f"'context_full' must be one of {list(CONTEXT_FULL)}, got {context_full!r}", "context_full"
            )
        replies = "parsed" if body.get("replies") is None else body["replies"]
        if replies not in REPLIES:
            raise bad_request(f"'replies' must be one of {list(REPLIES)}, got {replies!r}", "replies")
        sid = self.new_session_id()
        if owner is not None:
            await self._acquire(owner, sid)
        session = Session(
            id=sid,
            owner=owner,
            group_id=str(body.get("group_id") or sid),
            sample_index=sample_index,
            label=body.get("label"),
            env_name=str(body.get("env_name") or ""),
            env_version=str(body.get("env_version") or ""),
            sampling_params={**self.default_sampling, **sp},
            metadata=dict(body.get("metadata") or {}),
            capture=Capture(max_length=max_length),
            lease_s=float(lease_s) if lease_s is not None else None,
            context_full=context_full,
            replies=replies,
        )
        self.sessions[sid] = session
        self.num_open += 1
        self.metrics["molt_gateway_open_sessions"].inc()
        return session

    async def _acquire(self, owner: str, sid: str) -> None:
        cfg = self.settings.auth
        await self.release_closed()  # slots freed by sessions closed since, before counting
        try:
            taken = await self.limits.acquire(owner, sid)
        except Exception as exc:  # noqa: BLE001 - Redis: nothing is opened that could not be counted
            raise GatewayError(
                503,
                f"cannot count this API key's open sessions (Redis: {type(exc).__name__}: {exc}); retry shortly",
                code="limits_unavailable",
                retry_after_s=1,
            ) from None
        if not taken:
            raise GatewayError(
                429,
                f"this API key already holds {cfg.max_open_sessions_per_key} open sessions; finish or delete some",
                code="too_many_sessions",
                retry_after_s=cfg.retry_after_s,
            )

    async def release_closed(self) -> None:
        """Take the sessions closed since the last call off their keys' counts (a failure is logged: those slots
        then stay taken until their lease lapses, ``--auth.session_lease_s``)."""
        if not self._released:
            return
        closed, self._released = self._released, []
        try:
            await self.limits.release(closed)
        except Exception as exc:  # noqa: BLE001 - any Redis failure: logged, the counts lapse with the lease
            log.warning(
                "could not release %d sessions from their keys' open-session counts (they lapse within "
                "--auth.session_lease_s): %s",
                len(closed),
                exc,
            )

    def held_by_owner(self) -> dict[str, list[str]]:
        """The open sessions of this replica by API key (for the shared count's lease renewal)."""
        held: dict[str, list[str]] = {}
        for s in self.sessions.values():
            if s.state == "open" and s.owner is not None:
                held.setdefault(s.owner, []).append(s.id)
        return held

    def get_session(self, sid: str, owner: str | None, open_only: bool = True) -> Session:
        s = self.sessions.get(sid)
        if s is None or (self.settings.auth.api_keys and s.owner != owner):
            raise GatewayError(
                404, f"unknown session {sid!r}: open one with POST /v1/sessions", code="session_not_found"
            )
        if open_only and s.state != "open":
            raise GatewayError(409, f"session {sid} is {s.state}; open a new one", code="session_closed")
        return s

    def _close(self, s: Session, state: str, outcome: str, release: bool = True) -> None:
        """``release``: take it off its key's count (not when it was handed to another replica, still open)."""
        if s.state != "open":
            return
        s.state = state
        self.num_open -= 1
        if s.owner is not None and release:
            self._released.append((s.owner, s.id))
        if s.pod in self.pool.pods:
            self.pool.get(s.pod).sessions -= 1
        self.metrics["molt_gateway_open_sessions"].dec()
        self.metrics.child("molt_gateway_sessions_total", outcome).inc()
        s.closed_at = time.monotonic()
        s.last_result = None

    async def renew(self, sid: str, owner: str | None) -> dict:
        """Keep an open session's lease (``lease_s``) from lapsing: it counts as used now."""
        s = await self.session(sid, owner)
        s.last_used = time.monotonic()
        return {"session_id": sid, "lease_s": s.lease_s if s.lease_s is not None else self.settings.session.idle_ttl_s}

    async def abort(self, sid: str, owner: str | None) -> dict:
        s = await self.session(sid, owner, open_only=False)
        # A finish already writing decides: written, the abort is a 409; failed (503), the session is open
        # still and the abort goes on. Answering "aborted" meanwhile would contradict what lands in the stream.
        while s.finishing is not None:
            await s.finishing.wait()
        if s.state == "finished":
            raise GatewayError(409, f"session {sid} is already finished; nothing to abort", code="session_closed")
        self._close(s, "aborted", "aborted")
        self.sessions.pop(sid, None)
        await self.release_closed()
        return {"session_id": sid, "aborted": True}

    # ---- finishing

    async def finish(self, sid: str, owner: str | None, body: dict) -> dict:
        return (await self.finish_many([dict(body, session_id=sid)], owner, raise_single=True))[0]

    async def finish_many(self, items: list[dict], owner: str | None, raise_single: bool = False) -> list[dict]:
        """Finish several sessions; the trajectories go to the stream in one batch. Per-item results."""
        results: list[dict | None] = [None] * len(items)
        todo: list[tuple[int, Session, Trajectory | None]] = []
        locked: dict[str, Session] = {}
        try:
            for i, item in enumerate(items):
                try:
                    sid = item.get("session_id") if isinstance(item, dict) else None
                    if not isinstance(sid, str):
                        raise bad_request("each episode needs a 'session_id' string", "session_id")
                    s = await self.session(sid, owner, open_only=False)
                    if s.state == "open":
                        reward, score, info, truncated = read_outcome(item)
                        if sid in locked:
                            raise bad_request(f"session {sid} appears twice in one call", "session_id")
                        await s.lock.acquire()
                        locked[sid] = s
                    # Looked at again once the lock is held: an abort or another finish may have closed it while
                    # this one waited for a running turn.
                    if s.state == "finished":
                        results[i] = dict(s.result or {}, status=200)
                        continue
                    if s.state != "open":
                        raise GatewayError(
                            409, f"session {sid} is {s.state}; nothing to finish", code="session_closed"
                        )
                    s.finishing = asyncio.Event()
                    t = build_trajectory(
                        s, reward, score, info, truncated, self.settings.served_model_name, self.model
                    )
                    todo.append((i, s, t))
                except GatewayError as exc:
                    if raise_single:
                        raise
                    results[i] = {
                        "session_id": item.get("session_id") if isinstance(item, dict) else None,
                        "status": exc.status,
                        "error": {"message": exc.message, "code": exc.code},
                    }
            if self.settings.rollout.rescore_logprobs:  # a retried finish rebuilds and rescores its trajectories
                await rescore(self.pool, self.metrics, [(s, t) for _, s, t in todo if t is not None])
            written = await write_batch(
                self.queue, self.metrics, self.settings.session, [(s.id, t) for _, s, t in todo]
            )
            for (i, s, t), res in zip(todo, written):
                s.result = res
                self._close(s, "finished", "written" if t is not None else "empty")
                s.capture.segments = []  # free the tokens; the result stays for repeated finishes
                results[i] = dict(res, status=200)
        finally:
            for s in locked.values():
                if s.finishing is not None:
                    s.finishing.set()
                    s.finishing = None
                s.lock.release()
        await self.release_closed()
        return [r for r in results if r is not None]

    # ---- housekeeping

    def reap(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        ttl, keep = self.settings.session.idle_ttl_s, self.settings.session.finished_keep_s
        expired = 0
        for sid, s in list(self.sessions.items()):
            if s.state == "open" and now - s.last_used > (s.lease_s or ttl) and not s.lock.locked():
                self._close(s, "expired", "expired")
                del self.sessions[sid]
                expired += 1
            elif s.state != "open" and now - s.closed_at > keep:
                del self.sessions[sid]
        return expired

    async def renew_moved(self, now: float | None = None) -> int:
        """Renew the moved markers of the adopted sessions still open here once half their TTL has passed
        (handoff.py), so peers keep finding them however long they run; forget the closed ones."""
        if self.handoff is None:
            return 0
        now = time.monotonic() if now is None else now
        due = []
        for sid, marked in list(self._moved_marks.items()):
            s = self.sessions.get(sid)
            if s is None or s.state != "open":
                del self._moved_marks[sid]
            elif now - marked >= self.handoff.moved_ttl_s / 2:
                due.append(sid)
        if due:
            try:
                await self.handoff.renew_moved(due)
            except Exception as exc:  # noqa: BLE001 - tried again on the next pass
                log.warning("could not renew the moved markers of %d adopted sessions: %s", len(due), exc)
                return 0
            for sid in due:
                self._moved_marks[sid] = now
        return len(due)

    async def reap_loop(self) -> None:
        period = max(0.05, min(5.0, self.settings.session.idle_ttl_s / 4))  # a lease lapses up to this late
        while True:
            await asyncio.sleep(period)
            n = self.reap()
            if n:
                log.info("expired %d idle sessions", n)
            await self.release_closed()
            if self._moved_marks:
                await self.renew_moved()

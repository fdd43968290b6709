"""How every service serves, and how anything that starts one waits for it.

``python -m services.X`` parses its settings, builds its ASGI app and calls ``serve``: bind (printing
``molt-X listening on http://HOST:PORT``), serve with uvicorn (uvloop, httptools) behind the slow-client
guard (molt/serve_guard.py) and, but for the gateway, the request-body limit (molt/body_limit.py), print
``molt-X ready http://HOST:PORT`` once the app's start-up has run (then ``/readyz`` is the live answer), and on
SIGTERM drain, then shut down gracefully and exit 0. SIGINT skips the drain; a second signal, or SIGINT during
a drain, stops at once.

``wait_ready`` is the one way a supervisor (``molt up``), a test or a bench waits for a service: its
``/readyz`` answering 200 (``start_service`` starts one on a kernel-chosen port and waits for it).
``CPU_ENV`` is the one place the CPU defaults for child processes are set. ``preflight`` is the one place
start-up checks what the config names outside the process (a port to bind, a model directory, a Redis): each
service runs it right after parsing, before loading anything, and a problem ends it with one line that names
the flag and the fix. ``configure_logging`` is every service's one log line format.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from molt.body_limit import BodyLimit
from molt.config import ServerConfig
from molt.net import host_port, listening_socket
from molt.serve_guard import guarded

CPU_ENV = {
    "OMP_NUM_THREADS": "1",  # one OpenMP thread per process: several services share a few cores
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # vLLM's engine in the pod's own process
    "TOKENIZERS_PARALLELISM": "false",  # no tokenizer thread pools next to the event loop
    "HF_HUB_OFFLINE": "1",  # models are local directories; never reach the Hub
    "OMP_WAIT_POLICY": "PASSIVE",  # idle OpenMP threads sleep instead of spinning next to the event loop
}
"""Environment defaults for services started on a CPU machine (tests, benches, ``molt up``)."""

Drain = Callable[[], Awaitable[None]]
"""Runs on the first SIGTERM, before the graceful shutdown: returns once in-flight work may be cut."""


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_NOISE = (
    # torchao's wheel carries CUDA-only kernels (mxfp8, cutlass sm90a): without a GPU each fails to load, while
    # on a GPU the same line names a real torch/torchao mismatch.
    ("torchao", "Failed to load ", True),
    # torch asks torchao, not its users, to stop registering Enums as pytree constants.
    ("torch.utils._pytree", "is an Enum subclass", False),
    # vLLM's reload says this on every weight sync of layers the checkpoint does not fill (rotary caches, a
    # tied head). A layer truly left behind is a parameter the pod reports untouched, which the trainer logs.
    ("vllm.model_executor.model_loader.reload.layerwise", ": Failed to load weights", False),
)


class _Noise(logging.Filter):
    """Drops one dependency's warning that no user of ours can act on."""

    def __init__(self, text: str, only_without_gpu: bool) -> None:
        super().__init__()
        self.text, self.only_without_gpu = text, only_without_gpu

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text not in record.getMessage():
            return True
        if not self.only_without_gpu:
            return False
        torch = sys.modules.get("torch")
        return torch is not None and torch.cuda.is_available()


def configure_logging(level: str, rank: int | None = None) -> None:
    """Every service's logging: ``LOG_FORMAT`` (``rankN`` before the logger name in a trainer process) at
    ``level`` (``--server.log_level``). httpx logs each request at INFO, a line per episode in an env worker or
    a trainer, so below ``debug`` httpx and httpcore log from WARNING up. ``_NOISE`` lists the dependency
    log lines dropped; one dependency ``warnings`` message is dropped too."""
    fmt = LOG_FORMAT if rank is None else LOG_FORMAT.replace("%(name)s", f"rank{rank} %(name)s")
    logging.basicConfig(level=level.upper(), format=fmt)
    if logging.getLevelNamesMapping()[level.upper()] > logging.DEBUG:
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    for name, text, only_without_gpu in _NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Noise) and f.text == text for f in logger.filters):
            logger.addFilter(_Noise(text, only_without_gpu))
    # vLLM's kernel dispatcher reads every attribute of the modules it scans, touching torch's deprecated
    # alias on the way: a warning about vLLM's code, not the user's.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning, r"vllm\.")


def port_problem(host: str, port: int, flag: str = "--server.port") -> str | None:
    """Why ``host:port`` cannot be bound now (None: it can). Binds and closes at once, with the same SO_REUSEADDR
    the service binds with, so only a live listener or a bad address is reported; port 0 checks the address."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return f"{flag} {port}: {host}:{port} is already in use; pass a free port (0 lets the kernel pick one)"
        return f"{flag} {port}: cannot bind {host}:{port} ({exc.strerror}); check --server.host"
    finally:
        sock.close()
    return None


def model_dir_problem(path: str | None, flag: str = "--model.path") -> str | None:
    """Why ``path`` is not a local HF model directory (None: it is one)."""
    fix = "pass a local HF model directory (build a tiny one with `python -m molt.models tiny --out DIR`)"
    if not path:
        return f"{flag} is required: {fix}"
    if not Path(path).is_dir():
        return f"{flag} {path}: no such directory; {fix}"
    if not (Path(path) / "config.json").is_file():
        return f"{flag} {path}: not a model directory (no config.json); {fix}"
    return None


REDIS_BACKOFF_S = (0.2, 5.0)  # first wait and cap between two PINGs while a Redis does not answer at start-up


REDIS_MIN_VERSION = (6, 2)
"""XAUTOCLAIM, SMISMEMBER and XTRIM MINID, which the trajectory stream's reads, acks and trims use."""


def _redis_info(client: Any) -> dict:
    """INFO's server and cluster sections ({} where a proxy or managed service refuses INFO: not checked then)."""
    import redis

    try:
        return {**client.info("server"), **client.info("cluster")}
    except redis.ResponseError:
        return {}


def redis_unfit(info: dict) -> str | None:
    """Why a Redis that answers cannot hold the trajectory stream (None: it can), from its INFO fields. Refused at
    start-up, because at run time either failure would only show as a failed finish or read."""
    if str(info.get("cluster_enabled", "0")) == "1" or info.get("redis_mode") == "cluster":
        return (
            "this is a Redis Cluster node, which Molt does not support (the stream, its consumer group and the "
            "exactly-once sets are used together in one script, so they must live on one node); pass a "
            "standalone or primary/replica Redis (on managed services: cluster mode disabled)"
        )
    version = str(info.get("redis_version", ""))
    parts = [int(p) if p.isdigit() else 0 for p in version.split(".")[:2]]
    if version and tuple(parts) < REDIS_MIN_VERSION:
        need = ".".join(map(str, REDIS_MIN_VERSION))
        return f"Redis {version} is too old: Molt needs {need} or newer (XAUTOCLAIM, SMISMEMBER); upgrade it"
    return None


def redis_url_problem(url: str | None, flag: str = "--redis.url") -> str | None:
    """Why ``url`` is not a Redis URL at all (None: it is one, or unset); connects to nothing, so a dry run can
    ask too. The same check as ``--redis.url``'s at parse time, for flags parsed elsewhere (``--redis-url``)."""
    from molt.config import mask_secrets, redis_url

    if not url:
        return None
    try:
        redis_url(url)
    except ValueError as exc:
        return f"{flag} {mask_secrets(url)}: {exc}"
    return None


def redis_problem(
    url: str | None, flag: str = "--redis.url", wait_s: float = 5.0, wait_flag: str | None = None
) -> str | None:
    """Why the Redis at ``url`` cannot be used (None: it answers PING; unset and ``memory://`` are not checked).
    Retried with capped backoff for ``wait_s`` (``wait_flag`` sets it): in Kubernetes or compose the services
    and their Redis start in any order. A malformed URL (the parse-time check of ``--redis.url``, run here too
    for ``molt up --redis-url``) or a refused password is final at once."""
    if not url or url.startswith("memory://"):
        return None
    import redis

    from molt.config import mask_secrets

    malformed = redis_url_problem(url, flag)
    if malformed:
        return malformed
    deadline = time.monotonic() + wait_s
    delay, cap = REDIS_BACKOFF_S
    while True:
        try:
            with redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=2.0) as client:
                client.ping()
                unfit = redis_unfit(_redis_info(client))
            return None if unfit is None else f"{flag} {mask_secrets(url)}: {unfit}"
        except (redis.RedisError, ValueError, OSError) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            final = isinstance(exc, (redis.AuthenticationError, ValueError))
            if final or time.monotonic() + delay > deadline:
                waited = f" after {wait_s:g} s ({wait_flag})" if wait_flag and wait_s and not final else ""
                return (
                    f"{flag} {mask_secrets(url)}: Redis does not answer{waited} ({why}); start Redis there or pass "
                    "the URL of one that runs"
                )
            if delay == REDIS_BACKOFF_S[0]:  # once per start-up, on stdout: stderr holds only the error line
                hint = f" ({wait_flag}; 0 fails at once)" if wait_flag else ""
                print(f"{flag} {mask_secrets(url)}: waiting up to {wait_s:g} s{hint} for Redis ({why})", flush=True)
            time.sleep(delay)
            delay = min(delay * 2, cap)


def preflight(
    prog: str,
    *,
    ports: Iterable[tuple[str, str, int]] = (),
    models: Iterable[tuple[str, str | None]] = (),
    redis_url: str | None = None,
    redis_wait_s: float = 5.0,
) -> None:
    """Start-up checks, before anything is loaded: each ``(flag, host, port)`` is free, each ``(flag, path)`` is a
    model directory, ``redis_url`` (``--redis.url``) answers within ``redis_wait_s`` (``--redis.startup_wait_s``).
    The first problem exits: one line, status 2."""
    problems: tuple[Callable[[], str | None], ...] = (
        *(lambda f=flag, h=host, p=port: port_problem(h, p, f) for flag, host, port in ports),
        *(lambda f=flag, p=path: model_dir_problem(p, f) for flag, path in models),
        lambda: redis_problem(redis_url, wait_s=redis_wait_s, wait_flag="--redis.startup_wait_s"),
    )
    for check in problems:
        problem = check()
        if problem:
            print(f"{prog}: error: {problem}", file=sys.stderr, flush=True)
            raise SystemExit(2)


def cpu_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with ``CPU_ENV``'s defaults where unset."""
    return {**CPU_ENV, **(os.environ if env is None else env)}


def apply_cpu_env() -> None:
    """``CPU_ENV``'s defaults into this process's environment where unset (before torch or vLLM is imported)."""
    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)


def raise_fd_limit() -> None:
    """Lift this process's soft limit on open files to its hard limit: each client connection is one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


OWN_BODY_LIMIT = frozenset({"gateway"})
"""Services that limit request bodies themselves: the gateway per session (--session.max_body_bytes, its 413
``request_too_large`` in each wire's shape). A second, skeleton-wide limit would be one more flag to raise."""


def uvicorn_config(
    app: Any, server: ServerConfig, graceful_s: float = 10.0, *, body_limit: bool = True
) -> uvicorn.Config:
    """The uvicorn config every service serves with (the slow-client guard applied, and with ``body_limit`` the
    app behind ``--server.max_body_bytes``: molt/body_limit.py)."""
    config = uvicorn.Config(
        BodyLimit(app, server.max_body_bytes) if body_limit else app,
        log_level=server.log_level,
        access_log=False,
        loop="uvloop",
        http="httptools",
        ws="none",
        timeout_keep_alive=server.keep_alive_s,  # type: ignore[arg-type]  # a float works (asyncio timer)
        timeout_graceful_shutdown=max(1, round(graceful_s)),
    )
    # load() resolves http="httptools" to uvicorn's protocol class (Server.serve skips a loaded config); the guard
    # wraps that class by composition, calling only asyncio.Protocol's methods on it.
    config.load()
    config.http_protocol_class = guarded(
        config.http_protocol_class, server.header_timeout_s, server.max_pending_connections
    )
    return config


async def serve_async(
    service: str,
    app: Any,
    server: ServerConfig,
    *,
    drain: Drain | None = None,
    graceful_s: float = 10.0,
    signals: bool = True,
) -> None:
    """Bind, serve ``app`` and announce readiness; returns after shutdown. ``signals`` False leaves SIGTERM and
    SIGINT to the caller (the trainer, whose loop thread serves while the main thread trains): it stops
    the server by ``should_exit``."""
    raise_fd_limit()
    srv = _Server(uvicorn_config(app, server, graceful_s, body_limit=service not in OWN_BODY_LIMIT))
    if signals:  # from before the first line it prints: a supervisor may signal it at any point of its start
        srv.loop_handles_signals = True
        on_signal = _signal_handling(srv, drain)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
    sock = listening_socket(service, server.host, server.port)
    host, port = sock.getsockname()[:2]  # now: a stop during start-up closes the socket
    task = asyncio.ensure_future(srv.serve(sockets=[sock]))
    while not srv.started and not task.done():  # noqa: ASYNC110 - uvicorn offers a flag, not an event
        await asyncio.sleep(0.02)
    if srv.started and not srv.should_exit:
        freeze_heap()
        announce_ready(service, host, port)
    await task


def freeze_heap() -> None:
    """Move what start-up built (torch, vLLM, transformers, the tokenizer: millions of long-lived objects) out of
    the garbage collector's sight: a full collection would walk them again on the request path (a p99 spike),
    and the interpreter's exit would spend seconds of CPU collecting them."""
    gc.collect()
    gc.freeze()


def freeze_before_exit() -> None:
    """Last in a process's main, once its files are closed: the interpreter's exit would otherwise spend seconds
    of CPU collecting the torch / vLLM heap the process is about to drop (vLLM's engine shutdown unfreezes
    what ``freeze_heap`` froze)."""
    gc.freeze()


def announce_ready(service: str, host: str, port: int) -> None:
    """The line a service prints once its app has started: ``molt-<service> ready http://HOST:PORT``."""
    print(f"molt-{service} ready http://{host_port(host, port)}", flush=True)


def serve(
    service: str, app: Any, server: ServerConfig, *, drain: Drain | None = None, graceful_s: float = 10.0
) -> None:
    """``serve_async`` on uvloop, from a service's ``main``."""
    import uvloop

    uvloop.run(serve_async(service, app, server, drain=drain, graceful_s=graceful_s))


class _Server(uvicorn.Server):
    """uvicorn's server whose own signal hook (``handle_exit``, installed while it serves) leaves a signal to the
    event loop's handler when ``loop_handles_signals`` (``serve_async`` installs it before the service prints
    anything): the loop still gets the signal through its wakeup fd, so one handling holds throughout, and
    uvicorn never re-raises a signal after shutdown (its default, which makes a clean stop's exit status the
    signal's)."""

    loop_handles_signals = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.loop_handles_signals:
            super().handle_exit(sig, frame)


def _signal_handling(srv: uvicorn.Server, drain: Drain | None) -> Callable[[int], None]:
    """SIGTERM: drain, then the graceful shutdown. SIGINT: the graceful shutdown without the drain. A second
    signal of either kind, or SIGINT during a drain (someone at the terminal wants out): now."""
    draining: list[asyncio.Task] = []

    async def drain_then_exit() -> None:
        try:
            await drain()  # type: ignore[misc]  # installed only with a drain
        finally:
            srv.should_exit = True

    def on_signal(sig: int) -> None:
        if sig == signal.SIGINT:
            srv.force_exit = bool(srv.should_exit or draining)
            srv.should_exit = True
        elif drain is not None and not draining:
            draining.append(asyncio.get_running_loop().create_task(drain_then_exit()))
        elif srv.should_exit or draining:
            srv.should_exit = srv.force_exit = True
        else:
            srv.should_exit = True

    return on_signal


def wait_ready(url: str, timeout_s: float, alive: Callable[[], bool] | None = None, what: str = "service") -> None:
    """Block until ``url``/readyz answers 200. ``alive`` (e.g. a process's ``poll() is None``) is checked
    between tries: a service that exited raises at once. TimeoutError when it is not ready in time."""
    deadline = time.monotonic() + timeout_s
    ready_url = url.rstrip("/") + "/readyz"
    # One client for all tries: httpx.get would build one per try, each loading the CA bundle into a new TLS
    # context ten times a second; no kept-alive connection, so each try connects afresh.
    with httpx.Client(timeout=2, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while True:
            if alive is not None and not alive():
                raise RuntimeError(f"{what} exited before it was ready ({ready_url})")
            try:
                if client.get(ready_url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready at {ready_url} after {timeout_s:.0f} s")
            time.sleep(0.1)


_LISTENING = re.compile(r"^molt-\S+ listening on (http://\S+)")


def start_service(
    cmd: list[str],
    *,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout_s: float = 120.0,
) -> tuple[subprocess.Popen, str]:
    """Start a service (``cmd``: ``python -m services.X ... --server.port 0``), take its URL from the line it
    prints when it binds, and ``wait_ready`` for it; (process, URL). Its output is copied to ``log_path``
    (appended; discarded without one). The process is killed if it does not come up."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=cpu_env(env),
        cwd=cwd,
    )
    log = open(log_path, "a") if log_path is not None else None
    name = next((c for c in cmd if c.startswith("services.")), cmd[0])
    try:
        url = None
        deadline = time.monotonic() + timeout_s
        assert proc.stdout is not None
        while url is None:
            line = proc.stdout.readline()
            if log is not None:
                log.write(line)
                log.flush()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} before it listened; see {log_path}")
            match = _LISTENING.match(line)
            url = match.group(1) if match else None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not listen within {timeout_s:.0f} s; see {log_path}")
        threading.Thread(target=_copy, args=(proc, log), daemon=True).start()  # a full pipe would block it
        wait_ready(url, max(1.0, deadline - time.monotonic()), lambda: proc.poll() is None, name)
        return proc, url
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise


def _copy(proc: subprocess.Popen, log) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if log is not None:
            log.write(line)
            log.flush()
    if log is not None:
        log.close()

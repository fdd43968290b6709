"""Env-worker settings: ``python -m services.envs --agent NAME=PATH [--agent ...] --gateway.url URL``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from molt.config import GuardedServerConfig, Section, ServiceUrl


class GatewayClientConfig(Section):
    url: ServiceUrl | None = None
    """Root URL of the gateway (http://host:port) that episodes open their sessions on. Required."""
    timeout_s: float = 600.0
    """Timeout of one gateway call (a generate waits for the whole turn's generation)."""
    api_key: str | None = None
    """Bearer key for the gateway (needed when it runs with --auth.api_keys; env MOLT_GATEWAY__API_KEY).
    ChatAgents get it as ctx.api_key so their own SDK clients authenticate too."""


class WorkerConfig(Section):
    max_concurrency: int = Field(64, ge=1)
    """Episodes one worker runs at once; beyond it the worker answers 429 with Retry-After."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Wall-clock limit of one episode; past it the episode fails with status "timeout" (session aborted)."""
    retry_after_s: int = Field(1, ge=0)
    """Retry-After seconds sent with a 429."""
    session_lease_s: float = Field(60.0, ge=1)
    """Lease of each episode's gateway session, renewed every third of it while the episode runs: if this worker
    dies, the gateway closes its sessions this soon (instead of after its --session.idle_ttl_s)."""
    finish_retry_s: float = Field(300.0, ge=0)
    """How long an episode's finish is retried (with backoff) while the gateway answers 503 (its Redis is down)
    or cannot be reached; the gateway writes each trajectory once however often it is retried."""
    stall_warn_s: float = Field(10.0, ge=0)
    """Seconds the event loop may go without running (an agent's blocking call in an async method) before the
    worker logs where the code holding it is, the episodes in flight and the fix, and counts a stall in
    molt_envs_event_loop_stalls_total; then again every 6x that while it stays stuck. 0: no watchdog."""


class RolloutConfig(Section):
    max_new_tokens: int | None = Field(None, ge=1)
    """Per-turn token cap when an episode's sampling params carry no max_tokens (Molt's flag; None: the
    gateway's default, clamped to the remaining context budget)."""


class DataConfig(Section):
    max_len: int | None = Field(None, ge=2)
    """Total context budget of an episode (prompt + all turns) when the request gives no max_length
    (Molt's flag; None: the gateway's default)."""


class SandboxConfig(Section):
    isolation: Literal["auto", "bwrap", "none"] = "auto"
    """How agents' tool code runs (molt.agents.sandbox). auto/bwrap: an OS-isolated bubblewrap child (no network,
    own PID namespace, read-only filesystem, clean env, uid 65534); a host that cannot start one gets a clear
    error on every tool call. none: a plain subprocess with rlimits and an audit hook that code can switch
    off; trusted code only. Exported to the agents as MOLT_SANDBOX__ISOLATION."""


class EnvsSettings(Section):
    """Reward-env worker: runs agent episodes (Env or ChatAgent modules) through the gateway."""

    agent: list[str] = Field(default_factory=list)
    """Agent module to serve as NAME=PATH (a .py file exporting AgentRunner); repeat the flag for several."""
    gateway: GatewayClientConfig = Field(default_factory=GatewayClientConfig)
    envs: WorkerConfig = Field(default_factory=WorkerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    server: GuardedServerConfig = Field(default_factory=GuardedServerConfig)

    @field_validator("agent")
    @classmethod
    def _check_agents(cls, specs: list[str]) -> list[str]:
        names = set()
        for spec in specs:
            name, eq, path = spec.partition("=")
            if not eq or not name or not path:
                raise ValueError(f"--agent {spec!r}: expected NAME=PATH, e.g. --agent math=examples/agents/math.py")
            if name in names:
                raise ValueError(f"--agent: name {name!r} given twice")
            if not Path(path).is_file() or not path.endswith(".py"):
                raise ValueError(f"--agent {spec!r}: {path!r} is not an existing .py file")
            names.add(name)
        return specs

    def agents(self) -> dict[str, str]:
        """NAME -> PATH of every served agent module."""
        return dict(spec.partition("=")[::2] for spec in self.agent)


def validate_settings(settings: EnvsSettings) -> None:
    """The worker's start-up checks beyond each field's own (``ValueError``), run by --dry-run alike."""
    if not settings.gateway.url:
        raise ValueError("no gateway: pass --gateway.url http://HOST:PORT")
    if not settings.agent:
        raise ValueError("no agent to serve: pass --agent NAME=PATH (a .py file exporting AgentRunner)")
    from molt.auth import check_internal_exposure, internal_token_from_env

    # Episodes feed the training stream: nobody who merely reaches the worker may submit one (their label is
    # the reward's ground truth). A token, loopback, or an explicit opt-out.
    server = settings.server
    check_internal_exposure(
        internal_token_from_env(), server.host, server.allow_unauthenticated, "the env worker would run episodes for"
    )
    from molt.agents.sandbox import check_env_limits

    check_env_limits()


# Users repeat --agent (short --port / --host are expanded by molt.config).
def normalize_argv(argv: list[str]) -> list[str]:
    """Merge repeated ``--agent X`` into one list flag (unknown flags stay errors)."""
    out: list[str] = []
    agents: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name == "--agent":
            if eq:
                agents.append(value)
                i += 1
            else:
                i += 1
                while i < len(argv) and not argv[i].startswith("--"):
                    agents.append(argv[i])
                    i += 1
                if not agents:
                    out.append("--agent")  # let the parser report the missing value
            continue
        out.append(name + eq + value)
        i += 1
    return out + (["--agent", *agents] if agents else [])

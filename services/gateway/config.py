"""Gateway settings: ``python -m services.gateway --model.path DIR --rollout.urls URL ... --redis.url URL``."""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from molt.config import (
    ModelConfig,
    RedisConfig,
    Section,
    ServerConfig,
    ServiceUrl,
    http_url,
    json_object,
    split_list,
)
from services.gateway.templates import template_variables_in

# The widest head the gateway records (score centering's K); the wire's own top_logprobs stay OpenAI's 20.
MAX_RECORDED_TOP_LOGPROBS = 256


class RolloutClientConfig(Section):
    urls: list[ServiceUrl] = Field(default_factory=list)
    """Rollout pod base URLs (http://host:port); comma- or space-separated."""
    timeout_s: float = 600.0
    """Longest a generate call may take before the pod is treated as failed."""
    connect_timeout_s: float = 5.0
    """TCP connect timeout to a pod."""
    health_interval_s: float = 2.0
    """Seconds between /readyz probes of every pod (an unhealthy pod gets no new sessions)."""
    max_connections: int = 4096
    """Connection pool size shared by all pods."""
    stream: bool = True
    """Send generate calls to each pod over one long-lived full-duplex stream (POST /v1/generate_stream): each
    call is one line written at once, each answer one line back the moment it is done. Saves both ends the
    per-request HTTP work. Off: one HTTP request per call. Each URL must name one pod: behind a load-balancing
    URL the one stream would pin every call to one replica."""
    return_routed_experts: bool = False
    """Ask the pods for each token's MoE routed experts and record them in the trajectory (``routed_experts``),
    for the trainer's --train.routing_replay. Costs a recording pass per turn on pods where vLLM cannot return
    them itself (CPU)."""
    top_logprobs: int = 0
    """Ask the pods for the K most likely tokens at each generated token of a captured turn and record them in
    the trajectory (``top_ids`` / ``top_logprobs``, one row per action token), for the trainer's score centering
    (--actor.score_centering). 0: off. Above 20, the pods need --vllm.max_logprobs K (a pod with less is not
    routed to)."""
    rescore_logprobs: bool = False
    """At finish, re-read each trainable segment's action logprobs through one prefill pass on a pod and record
    those (the trainer's recompute is prefill-like; decode kernels may differ, e.g. Qwen3.x GDN). Costs one
    prefill per segment; segments that cannot be rescored exactly keep theirs, counted (docs/gateway.md)."""

    @field_validator("urls", mode="before")
    @classmethod
    def _split(cls, urls: Any) -> Any:
        return split_list(urls)

    @field_validator("top_logprobs")
    @classmethod
    def _top_in_bounds(cls, k: int) -> int:
        if not 0 <= k <= MAX_RECORDED_TOP_LOGPROBS:
            raise ValueError(
                f"must be in [0, {MAX_RECORDED_TOP_LOGPROBS}] (0: record none): each row costs 8 bytes per action "
                "token in every trajectory"
            )
        return k


class AuthConfig(Section):
    api_keys: list[str] = Field(default_factory=list)
    """Bearer API keys (also read as x-api-key). Empty: no auth, and the gateway binds loopback only."""
    max_open_sessions_per_key: int = 1024
    """Open sessions one key may hold across all replicas (counted in Redis); more get 429 with Retry-After."""
    session_lease_s: float = Field(60.0, gt=0)
    """Lease of a session's entry in its key's count in Redis, renewed every third of it by the replica holding
    the session; if that replica dies, its sessions stop counting against their keys after this long."""
    retry_after_s: int = 5
    """Retry-After seconds sent with a 429."""


class SessionConfig(Section):
    idle_ttl_s: float = 1800.0
    """Sessions idle this long are dropped (nothing written) and counted as expired."""
    finished_keep_s: float = 600.0
    """How long a finished session's result is kept so a repeated finish is answered the same way; also how long
    a finish retried after a failed attempt is known not to write its trajectory twice."""
    finish_wait_s: float = Field(10.0, ge=0)
    """How long a finish waits for Redis (down, restarting) or for room in a full stream before answering 503
    with Retry-After; the session then stays open with its trajectory until it is finished again."""
    drain_s: float = 0.0
    """On SIGTERM, keep serving the open sessions up to this long before exiting (new sessions get 503
    ``draining``, ``/readyz`` 503), and exit as soon as none is open; 0 exits at once. Episodes survive a
    rolling update or a scale-down this way; give the pod a longer termination grace period."""
    handoff: bool = True
    """With the trajectory stream on Redis: sessions still open when this replica exits are parked there, and
    the next replica a request for one reaches goes on with it (services/gateway/handoff.py). Off, or without
    Redis, they are lost (counted as ``outcome="lost"``)."""
    max_length: int = 4096
    """Default context budget per segment (prompt + generated tokens) when a session gives none."""
    max_tokens: int = 1024
    """Default max new tokens per turn when neither the session nor the request sets it."""
    temperature: float = 1.0
    """Default sampling temperature (rollouts sample at 1.0)."""
    top_p: float = 1.0
    """Default top_p (keep 1.0 when importance-sampling correction is on)."""
    max_body_bytes: int = 32 << 20
    """Largest request body accepted; bigger gets 413."""


class ReplicaConfig(Section):
    public_url: str = ""
    """This replica's own URL as the other replicas reach it (e.g. http://POD_IP:8080). Set it when several
    replicas share one Service: a session lives on the replica that opened it, its id then names that replica
    (signed with the API keys, so only ids a replica issued are followed), and a request for it that reaches
    another replica is forwarded there. Empty: one replica, plain ids, nothing forwarded. An IPv6 address may
    come bare, as Kubernetes expands ``$(POD_IP)`` (``http://fd00::7:8080``): when a port follows it, it is
    bracketed here (``http://[fd00::7]:8080``)."""

    @field_validator("public_url")
    @classmethod
    def _check(cls, url: str) -> str:
        url = url.strip().rstrip("/")
        return http_url(_bracket_ipv6(url)) if url else ""


def _bracket_ipv6(url: str) -> str:
    """``http://fd00::7:8080/x`` -> ``http://[fd00::7]:8080/x``; any other URL as it is. The last ``:N`` is read as
    the port (the chart always appends one), so the address is what comes before it."""
    scheme, _, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    host, _, port = netloc.rpartition(":")
    if netloc.count(":") < 2 or "[" in netloc or not port.isdigit():
        return url
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise ValueError(
            f"--replica.public_url: {url!r}: write an IPv6 address in brackets, e.g. http://[fd00::7]:8080"
        ) from None
    return f"{scheme}://[{host}]:{port}{slash}{path}"


class FetchConfig(Section):
    fetch_images: bool = False
    """Fetch the http(s) image URLs clients send (OpenAI ``image_url``, Responses ``input_image``, Anthropic
    ``url`` sources) and inline the files. Off: such URLs are a 400. On: public hosts only, or the hosts of
    ``--gateway.fetch_allow_hosts``; restrict the gateway's egress too (e.g. a NetworkPolicy)."""
    fetch_timeout_s: float = Field(10.0, gt=0)
    """Longest one image fetch may take (connect, redirects and body)."""
    fetch_max_bytes: int = Field(10 << 20, gt=0)
    """Largest image file fetched; a longer body is a 400 as soon as it passes this."""
    fetch_max_images: int = Field(16, gt=0)
    """Most image URLs one request may name."""
    fetch_allow_hosts: list[str] = Field(default_factory=list)
    """Hosts image URLs may name (exact names, or ``*.domain``), wherever they resolve. Empty: any host whose
    addresses are all public (loopback, private and link-local ones, cloud metadata included, are refused)."""


class WireConfig(FetchConfig):
    reasoning_field: Literal["reasoning_content", "reasoning"] = "reasoning_content"
    """Field of an OpenAI chat reply (and of its stream's deltas) that holds the think block:
    ``reasoning_content`` as DeepSeek's API and SGLang name it, or ``reasoning`` as vLLM's server names it
    since it deprecated ``reasoning_content``. Only one is sent: a client that reads both would show it twice."""
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Template variables every render sees unless a request's ``chat_template_kwargs`` sets them (vLLM's
    --default-chat-template-kwargs), a JSON object: '{"enable_thinking": false}' renders Qwen3 without think
    blocks, session prompts and an env's rendered prompt included. Only variables the template reads."""

    @field_validator("default_chat_template_kwargs", mode="before")
    @classmethod
    def _kwargs_object(cls, v: Any) -> Any:
        return json_object(v, '{"enable_thinking": false}', "chat template variables") or {}


class GatewaySettings(Section):
    """OpenAI/Anthropic-compatible gateway that records token-exact trajectories to a Redis stream."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    served_model_name: str = "policy"
    """Model id the wires report and accept."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    rollout: RolloutClientConfig = Field(default_factory=RolloutClientConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    session: SessionConfig = Field(default_factory=SessionConfig)
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    gateway: WireConfig = Field(default_factory=WireConfig)

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        if any(not k.strip() for k in self.auth.api_keys):
            # An empty key (an empty Secret value, a stray quote) would match a request that sends no key.
            raise ValueError("--auth.api_keys: a key is empty or blank; give non-empty keys (or none for loopback)")
        if not self.auth.api_keys and not _is_loopback(self.server.host):
            raise ValueError(
                f"refusing to bind {self.server.host} without API keys: set --auth.api_keys KEY "
                "(or MOLT_AUTH__API_KEYS) or bind --server.host 127.0.0.1"
            )
        if self.replica.public_url and not self.auth.api_keys:
            raise ValueError(
                "--replica.public_url needs --auth.api_keys: the keys sign the session ids that tell "
                "the replicas where each session lives (every replica must get the same keys)"
            )
        return self


def validate_settings(settings: GatewaySettings) -> None:
    """The gateway's start-up checks beyond each field's own (``ValueError``), run by --dry-run alike."""
    if not settings.model.path:
        raise ValueError("no model: pass --model.path DIR (the tokenizer and chat template come from it)")
    if settings.rollout.rescore_logprobs and settings.rollout.top_logprobs:
        raise ValueError(
            "--rollout.rescore_logprobs and --rollout.top_logprobs K > 0 do not go together: the rescored tokens' "
            "logprobs would come from the prefill pass and their top-K rows from decoding; drop one of them"
        )
    defaults = settings.gateway.default_chat_template_kwargs
    if defaults:
        reads = template_variables_in(settings.model.path)
        unknown = sorted(k for k in defaults if reads is not None and k not in reads)
        if unknown:
            raise ValueError(
                f"--gateway.default_chat_template_kwargs: the model's chat template does not read {unknown}; "
                f"it reads {sorted(reads or ())}"
            )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

"""Typed, layered configuration with Molt-style dotted flags.

Every service describes its settings as nested pydantic models. A field's docstring (the string
literal right under it) is its help text. Values are layered once, at start-up:

    defaults  <  environment (MOLT_<GROUP>__<FIELD>, e.g. MOLT_REDIS__URL)  <  dotted CLI flags

Flags mirror the nesting: ``--algo.advantage.estimator grpo``. Unknown flags are rejected with the
closest known name; ``--dry-run`` runs the service's cross-flag checks (``validate``, the same function
start-up runs), then prints the resolved config as JSON and exits. Booleans accept a
bare flag (``--train.routing_replay``), an explicit value (``--train.routing_replay false``) or the
``--no-`` form. List fields take several values (``--algo.advantage.is_correction_threshold 0.5 5``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "MOLT_"
_S = TypeVar("_S", bound="Section")


class Section(BaseModel):
    """Base for every config block: field docstrings become help text, unknown keys are errors."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", validate_assignment=True)


# ---- flag values checked when the flags are parsed (so --dry-run refuses them too). Each check's message says
# what is wrong and the fix; the parser puts the flag and the value given in front of it.

PORT_MAX = 65535
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def port_range(zero: str) -> AfterValidator:
    """A port flag's check: 0..65535, ``zero`` saying what 0 means for that flag."""

    def check(port: int) -> int:
        if not 0 <= port <= PORT_MAX:
            raise ValueError(f"not a port number; pass one in 1..{PORT_MAX}, or 0 ({zero})")
        return port

    return AfterValidator(check)


Port = Annotated[int, port_range("the kernel picks a free port")]


def http_url(url: str) -> str:
    """A service's base URL as every URL flag takes it: http(s), a host, and a valid port if one is given
    (``ValueError`` otherwise). Returned without surrounding blanks or a trailing slash, since callers append
    paths to it. Checked at parse time: a worker with a bad URL would otherwise serve and fail every call."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - reading it raises ValueError on a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"not an http(s) URL ({exc}); pass one like http://HOST:PORT") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s) URL with a host; pass one like http://HOST:PORT, e.g. http://127.0.0.1:8000")
    return url


ServiceUrl = Annotated[str, AfterValidator(http_url)]


def host_port(target: str) -> str:
    """A gRPC target as HOST:PORT (``ValueError`` otherwise): a URL or a missing port would only fail at the first
    weight push, after the model has loaded."""
    target = target.strip()
    host, sep, port = target.rpartition(":")
    if "://" in target or not sep or not host or not port.isdigit() or not 1 <= int(port) <= PORT_MAX:
        raise ValueError(f"not HOST:PORT with a port in 1..{PORT_MAX}; pass one like 127.0.0.1:50051")
    return target


HostPort = Annotated[str, AfterValidator(host_port)]


def split_list(values: Any) -> Any:
    """A list flag's items split at commas and blanks (``--rollout.urls A,B C``), for a ``mode="before"`` field
    validator: the split items are what the item type then checks. Anything but a list is left to pydantic."""
    if not isinstance(values, list):
        return values
    return [v for item in values for v in str(item).replace(",", " ").split()]


def json_object(value: Any, example: str, of_what: str = "") -> Any:
    """A JSON-object flag for a ``mode="before"`` field validator: JSON text from the command line or an
    environment variable, an object from a config or Helm values; blank is None. Anything but an object is
    refused with ``example``, a valid value, in the message (``of_what``: what its keys are)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc.msg} at character {exc.pos})") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"must be a JSON object{' of ' + of_what if of_what else ''}, e.g. '{example}'")
    return value


def redis_url(url: str) -> str:
    """A URL redis-py connects with (checked by its own parser), or ``memory://`` (the in-process queue of one
    process). A malformed URL is final: waiting for such a Redis to answer could never end well."""
    if url.startswith("memory://"):
        return url
    fix = "pass one like redis://HOST:6379/0 (schemes: redis://, rediss://, unix://)"
    if not url.lower().startswith(REDIS_SCHEMES):
        raise ValueError(f"not a Redis URL; {fix}")
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError as exc:
        raise ValueError(f"not a Redis URL ({exc}); {fix}") from None
    return url


# ---- shared blocks (every service that talks to Redis / serves metrics / loads a model uses these)


class RedisConfig(Section):
    url: Annotated[str, AfterValidator(redis_url)] | None = None
    """Redis URL: redis://[:PASSWORD@]HOST:PORT/DB, rediss:// (TLS) or unix://PATH; memory:// keeps the queue in
    this process. Unset: the local stack starts an embedded server."""
    stream: str = "molt:trajectories"
    """Name of the trajectory stream."""
    group: str = "trainer"
    """Consumer group that trains on the stream."""
    max_len: int = 100_000
    """Backpressure: producers wait (never trim unacked data) while the stream holds this many entries."""
    dead_letter_stream: str | None = None
    """Stream for records that fail to decode. Default: <stream>:dead."""
    consumed_keep_s: float = Field(86400.0, gt=0)
    """How long the trainer remembers each trajectory id it trained, to skip a second stream entry of it (a
    producer's repeated write). Redis holds about one id per trajectory trained in this window; it must outlast
    the gateway's --session.finished_keep_s, the window in which a retried finish could write one twice."""
    startup_wait_s: float = Field(60.0, ge=0)
    """At start-up: how long to wait for --redis.url to answer (a Redis started beside the service, in any
    order), retrying with backoff before the service listens (so it is not ready); then it exits with one line."""


class MetricsConfig(Section):
    port: Port | None = None
    """Port of a separate Prometheus endpoint (0: the kernel picks). Unset: /metrics is served on the service's
    own port."""


class ModelConfig(Section):
    path: str | None = None
    """Local model directory (HF layout). Nothing is downloaded: build one with `python -m molt.models`."""


class ServerConfig(Section):
    host: str = "127.0.0.1"
    """Address to bind. Loopback by default; set 0.0.0.0 in containers."""
    port: Port = 0
    """Port to bind, 0..65535; 0 lets the kernel pick (the chosen port is logged)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the service."""
    keep_alive_s: float = Field(75.0, gt=0)
    """Seconds an idle client connection is kept open. Longer than clients keep theirs (httpx 5 s, aiohttp 15 s),
    so the client closes first: a request it writes into a connection the server is closing fails. Agents
    leave connections idle between turns while their tools run."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A new connection whose first request head has not arrived within this many seconds is closed (slow
    clients must not hold connections: molt/serve_guard.py)."""
    max_pending_connections: int = Field(1000, ge=1)
    """Connections still waiting for their first request head; past this the longest-waiting one is closed."""
    body_timeout_s: float = Field(60.0, gt=0)
    """Longest wait for each piece of a request body; past it the request gets a 408 (the gateway)."""
    max_body_bytes: int = Field(64 << 20, gt=0)
    """Largest request body the rollout pod, env worker and trainer read; a bigger one gets 413 before it is held
    whole (molt/body_limit.py). Above the gateway's default request so what it forwards fits (prompts as token
    ids, images as base64); the gateway itself limits by --session.max_body_bytes and ignores this."""


class GuardedServerConfig(ServerConfig):
    """``--server.*`` of the services guarded by the service token (molt/auth.py): rollout pods, env workers."""

    allow_unauthenticated: bool = False
    """Serve without MOLT_INTERNAL_TOKEN on a non-loopback address (e.g. behind a NetworkPolicy the cluster
    enforces). Off: such a service refuses to start unless the token is set (env only, never a flag). With the
    token set, every route but /healthz, /readyz and /metrics needs Authorization: Bearer <token>."""


# ---- CLI machinery


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_section(tp: Any) -> bool:
    tp = _unwrap_optional(tp)
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def iter_fields(model: type[BaseModel], prefix: str = "") -> typing.Iterator[tuple[str, Any, Any]]:
    """Yield (dotted name, annotation, FieldInfo) for every leaf field, depth first."""
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        if _is_section(info.annotation):
            yield from iter_fields(_unwrap_optional(info.annotation), dotted + ".")
        else:
            yield dotted, info.annotation, info


def _is_list(tp: Any) -> bool:
    return typing.get_origin(_unwrap_optional(tp)) in (list, tuple)


def _is_bool(tp: Any) -> bool:
    return _unwrap_optional(tp) is bool


def _choices(tp: Any) -> list[str] | None:
    tp = _unwrap_optional(tp)
    if typing.get_origin(tp) is Literal:
        return [str(c) for c in typing.get_args(tp)]
    return None


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _parse_scalar_env(raw: str, annotation: Any) -> Any:
    if _is_list(annotation):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return [x for x in raw.replace(",", " ").split() if x]
    return raw


def env_overrides(model: type[BaseModel], environ: typing.Mapping[str, str] | None = None) -> dict[str, Any]:
    """Nested dict of values taken from MOLT_<A>__<B> variables for the model's fields."""
    environ = os.environ if environ is None else environ
    tree: dict[str, Any] = {}
    for dotted, annotation, _ in iter_fields(model):
        key = ENV_PREFIX + dotted.upper().replace(".", "__")
        if key in environ:
            _set_dotted(tree, dotted, _parse_scalar_env(environ[key], annotation))
    return tree


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _bool_value(raw: str) -> bool:
    low = raw.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {raw!r}")


# Names other frameworks give Molt's learning rate (OpenRLHF's --actor_learning_rate, TRL's learning_rate).
_LEAF_ALIASES = {"lr": "adam.lr", "learning_rate": "adam.lr"}


def suggest_flag(name: str, known: typing.Iterable[str], cutoff: float = 0.6) -> str | None:
    """The flag an unknown dotted ``name`` most likely meant (both without dashes), or None. A known flag with
    the same last part in another section comes first (--train.save_steps: --ckpt.save_steps), then the
    learning rate's other names, then the closest spelling."""
    known = sorted(known)
    section, _, leaf = name.rpartition(".")
    leaf = _LEAF_ALIASES.get(leaf, leaf)
    same = [k for k in known if k == leaf or k.endswith("." + leaf)]
    if same:  # several sections have it (train.seed, vllm.seed): the one nearest in spelling, actor's first
        near = difflib.get_close_matches(name, same, n=1, cutoff=0.0)
        ours = [k for k in same if k.startswith(section + ".")] or [k for k in same if k.startswith("actor.")]
        return (ours or near or same)[0]
    match = difflib.get_close_matches(name, known, n=1, cutoff=cutoff)
    return match[0] if match else None


class _Parser(argparse.ArgumentParser):
    def __init__(self, *a: Any, known: list[str], **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._known = known

    def error(self, message: str) -> typing.NoReturn:
        # argparse words unknown flags as "unrecognized arguments: --foo"; add a suggestion.
        if "unrecognized arguments" in message:
            bad = [t for t in message.split(":", 1)[1].split() if t.startswith("--")]
            hints = []
            for flag in bad:
                match = suggest_flag(flag.split("=")[0][2:], [k[2:] for k in self._known], cutoff=0.5)
                hints.append(f"{flag}: did you mean --{match}?" if match else f"{flag}: no such flag")
            if hints:
                message = "unknown flag(s): " + "; ".join(hints)
        # One line, not argparse's usage first: a service's usage runs to hundreds of lines and buries the error.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(model: type[BaseModel], prog: str, description: str | None = None) -> argparse.ArgumentParser:
    flags = ["--" + d for d, _, _ in iter_fields(model)]
    parser = _Parser(
        prog=prog,
        description=description or (model.__doc__ or "").strip(),
        allow_abbrev=False,
        known=flags + ["--dry-run", "--help"],
    )
    parser.add_argument("--dry-run", action="store_true", help="Print the resolved config as JSON and exit.")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for dotted, annotation, info in iter_fields(model):
        head = dotted.split(".")[0] if "." in dotted else "general"
        group = groups.setdefault(head, parser.add_argument_group(head))
        help_text = (info.description or "").replace("%", "%%")
        kw: dict[str, Any] = {"dest": dotted, "default": argparse.SUPPRESS, "help": help_text}
        default = info.get_default(call_default_factory=True)
        if default is not None and not info.is_required() and default != []:
            kw["help"] = help_text + f" [default: {default}]".replace("%", "%%")
        kw.pop("default")
        if _is_bool(annotation):
            group.add_argument(
                f"--{dotted}", nargs="?", const=True, type=_bool_value, default=argparse.SUPPRESS, metavar="BOOL", **kw
            )
            group.add_argument(
                f"--no-{dotted}", dest=dotted, action="store_false", default=argparse.SUPPRESS, help=argparse.SUPPRESS
            )
        elif _is_list(annotation):
            group.add_argument(f"--{dotted}", nargs="+", default=argparse.SUPPRESS, metavar="V", **kw)
        else:
            choices = _choices(annotation)
            group.add_argument(
                f"--{dotted}",
                default=argparse.SUPPRESS,
                choices=choices,
                metavar="{" + ",".join(choices) + "}" if choices else None,
                **kw,
            )
    return parser


def _format_validation_error(err: ValidationError) -> str:
    """One line for one bad flag (the usual case); one line per flag under a heading for several."""
    lines = [_error_line(e) for e in err.errors()]
    return lines[0] if len(lines) == 1 else "invalid configuration:\n" + "\n".join("  " + line for line in lines)


def _error_line(e: Any) -> str:
    # A list item's index is not part of the flag name: the value shown says which item it is.
    name = ".".join(str(p) for p in e["loc"] if not isinstance(p, int))
    value = mask_secrets(e.get("input"), name)
    cause = e.get("ctx", {}).get("error")
    if not isinstance(cause, ValueError):  # pydantic's own wording (a type, a bound)
        return f"--{name}: {e['msg']} (got {value!r})"
    msg = str(cause)
    if msg.startswith("--") or not name:  # a cross-field check that names its flags itself
        return msg
    return f"--{name} {value}: {msg}" if isinstance(value, (str, int, float)) else f"--{name}: {msg}"


# Short forms every service accepts, for the commands people type most: `--model DIR --port N --host H`.
SHORT_FLAGS = {"--model": "--model.path", "--port": "--server.port", "--host": "--server.host"}


def expand_short_flags(argv: list[str], known: set[str] | None = None) -> list[str]:
    """``--port 8000`` / ``--port=8000`` -> ``--server.port ...``. With ``known`` (the model's flags), only
    where the short name is not a flag of its own and the dotted target exists."""
    short = {k: v for k, v in SHORT_FLAGS.items() if known is None or (k not in known and v in known)}
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        out.append(short[name] + eq + value if name in short else arg)
    return out


def parse_settings(
    model: type[_S],
    argv: list[str] | None = None,
    prog: str | None = None,
    environ: typing.Mapping[str, str] | None = None,
    validate: Callable[[_S], object] | None = None,
) -> _S:
    """Resolve defaults < env < flags into a validated ``model`` instance.

    ``validate`` is the service's cross-flag check (it may fill derived defaults; a ``ValueError`` rejects the
    config): it runs here, before ``--dry-run`` prints, so a dry run rejects exactly what start-up rejects.
    Exits with status 2 and a message that names the flag on bad input; with ``--dry-run`` prints
    the resolved config and exits 0.
    """
    parser = build_parser(model, prog or sys.argv[0])
    known = {"--" + d for d, _, _ in iter_fields(model)}
    ns = parser.parse_args(expand_short_flags(sys.argv[1:] if argv is None else argv, known))
    raw = vars(ns)
    dry_run = raw.pop("dry_run", False)
    tree: dict[str, Any] = {}
    for dotted, value in raw.items():
        _set_dotted(tree, dotted, value)
    data = _deep_merge(env_overrides(model, environ), tree)
    try:
        settings = model.model_validate(data)
        if validate is not None:
            validate(settings)
    except (ValidationError, ValueError) as exc:
        msg = _format_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        parser.exit(2, f"{parser.prog}: error: {msg}\n")
    if dry_run:
        print(json.dumps(mask_secrets(settings.model_dump(mode="json")), indent=2))
        parser.exit(0)
    return settings


_SECRET_ENDINGS = {"key", "keys", "password", "passwd", "secret", "token", "credential", "credentials"}
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/@:\s]*:)(?P<password>[^/@\s]+)(?=@)", re.IGNORECASE)
# redis-py also reads the password from the query (``?password=...``).
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)(?P<password>[^&#\s]+)", re.IGNORECASE)
MASK = "***"


def mask_secrets(value: Any, name: str = "") -> Any:
    """A resolved config with its secrets masked, for ``--dry-run``: any field named like a key, password,
    secret, token or credential (API keys, weight-sync credentials), and the password inside any URL
    (``redis://:PASSWORD@host``, ``redis://host?password=PASSWORD``). Counts (``max_*``, ``num_*``) are not secrets."""
    leaf = name.rsplit(".", 1)[-1].lower()
    secret = leaf.split("_")[-1] in _SECRET_ENDINGS and not leaf.startswith(("max_", "num_", "min_"))
    if isinstance(value, dict):
        return {k: mask_secrets(v, f"{name}.{k}" if name else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v, name) for v in value]
    if secret and value not in (None, "", False):
        return MASK
    if isinstance(value, str):
        value = _URL_PASSWORD.sub(lambda m: m["head"] + MASK, value)
        return _QUERY_PASSWORD.sub(lambda m: m["head"] + MASK, value) if "://" in value else value
    return value


__all__ = [
    "Field",
    "MetricsConfig",
    "ModelConfig",
    "Port",
    "RedisConfig",
    "Section",
    "ServerConfig",
    "ServiceUrl",
    "build_parser",
    "env_overrides",
    "expand_short_flags",
    "http_url",
    "iter_fields",
    "parse_settings",
    "port_range",
    "redis_url",
    "split_list",
]

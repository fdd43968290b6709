"""docker-compose.yml validates against the compose-spec JSON schema (shipped in the docker-compose
1.29.2 wheel, fetched once into .cache/tools/), starts services in health order, gives the GPU
services their devices, and runs commands the services accept. The Dockerfiles copy only paths that
exist and start the right modules; Prometheus scrapes every service; Grafana gets the dashboard.
No Docker engine runs here: these are static checks plus the services' own argument parsers."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]




from deploy import tools  # noqa: E402
ENV = {"MOLT_API_KEY": "sk-test-0123456789abcdef"}
HTTP_PORTS = {"rollout": 8000, "gateway": 8080, "envs": 8090}
DOCKERFILES = {"rollout": "rollout.Dockerfile", "trainer": "trainer.Dockerfile", "gateway": "service.Dockerfile",
               "envs": "service.Dockerfile"}


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


def test_api_key_is_required():
    with pytest.raises(KeyError, match="MOLT_API_KEY"):
        tools.load_compose({})


def test_services_start_in_health_order(compose):
    services = compose["services"]
    assert set(services) == {"redis", "rollout", "gateway", "envs", "trainer", "prometheus", "grafana"}
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            assert cond["condition"] == "service_healthy", (name, dep)
            assert "healthcheck" in services[dep], f"{name} waits on {dep}, which has no healthcheck"
    assert set(services["gateway"]["depends_on"]) == {"redis", "rollout"}
    assert set(services["envs"]["depends_on"]) == {"gateway"}
    assert set(services["trainer"]["depends_on"]) == {"redis", "rollout", "envs"}
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
    if tools.parse_service(service, argv, env, agent_dir=tmp_path) is None:
        pytest.skip(f"services.{name} has no settings module yet")


def test_prometheus_scrapes_every_service(compose):
    prom = compose["services"]["prometheus"]
    mount = next(v for v in prom["volumes"] if v.endswith("/etc/prometheus/prometheus.yml:ro"))
    config = yaml.safe_load((ROOT / mount.split(":")[0]).read_text())
    targets = {}
    for job in config["scrape_configs"]:
        assert job["honor_labels"] is True, job["job_name"]  # keep services' own `pod` label
        for sc in job["static_configs"]:
            assert "pod" in sc["labels"]
            for t in sc["targets"]:
                host, port = t.split(":")
                targets[host] = int(port)
    metrics_port = int(re.search(r"--metrics\.port=(\d+)", " ".join(compose["services"]["trainer"]["command"]))[1])
    assert targets == {**HTTP_PORTS, "trainer": metrics_port}


def test_grafana_gets_datasource_and_dashboard(compose):
    vols = {v.split(":")[1]: ROOT / v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]
            if v.startswith("./")}
    dash_dir = vols["/var/lib/grafana/dashboards/molt"]
    assert (dash_dir / "molt-overview.json").is_file()
    prov = vols["/etc/grafana/provisioning"]
    provider = yaml.safe_load((prov / "dashboards" / "molt.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/molt"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["isDefault"]


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


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
    code = ("import sys\nfor m in ('torch', 'vllm', 'nemo_automodel'): sys.modules[m] = None\n"
            f"import services.{service}.app, services.{service}.__main__\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]

"""What docs/deploy.md promises about chart values and the compose file, checked on what Helm renders
and on the parsed docker-compose.yml.

- networkPolicy.ncclWeightSync: a collective weight push (one process group of the trainer and every
  rollout pod, ephemeral ports) is admitted between trainer and pods and among pods, and nowhere else.
- networkPolicy.dnsTo: the only DNS env workers (and the tools they run) may query, on port 53.
- networkPolicy.metricsFrom: reaches the port every ServiceMonitor scrapes, and no other port.
- redis.auth.existingSecret: every Redis consumer reads the password from it; the chart renders none.
- The env worker may run bubblewrap sandboxes in compose as in the chart, and both agree on the
  settings, Redis flags, checkpoints and ports they give each service.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from deploy import tools

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ("Deployment", "StatefulSet")
MOLT = ("rollout", "gateway", "envs", "trainer")
K8S_VERSIONS = ("1.28.0", "1.37.0")
MONITORING = ("monitoring.coreos.com/v1",)
COMPOSE_ENV = {
    "MOLT_API_KEY": "sk-test-0123456789abcdef",
    "MOLT_REDIS_PASSWORD": "redis-test-password",
    "MOLT_WEIGHTS_TOKEN": "weights-test-token",
    "MOLT_INTERNAL_TOKEN": "internal-test-token",
}
# A port no container names: collective groups (NCCL, gloo) connect on ephemeral ports like it.
EPHEMERAL = 41234
APPARMOR_ENVS = "container.apparmor.security.beta.kubernetes.io/envs"


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict]) -> dict[str, dict]:
    """component -> its Deployment or StatefulSet."""
    return {
        w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: w
        for kind in WORKLOADS
        for w in by_kind(docs, kind).values()
    }


def main_container(docs: list[dict], component: str) -> dict:
    return workloads(docs)[component]["spec"]["template"]["spec"]["containers"][0]


def render_with(tmp_path: Path, values: dict, *, api_versions: tuple[str, ...] = ()) -> list[dict]:
    """Render with a values file (peer lists do not fit --set)."""
    path = tmp_path / f"values-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(values))
    return tools.render(str(path), api_versions=api_versions)


def validate(docs: list[dict], kinds: tuple[str, ...]) -> None:
    for doc in docs:
        if doc["kind"] in kinds:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


# ---- NetworkPolicy evaluation: which peer a rendered rule admits on which container port.


def _port_number(docs: list[dict], component: str, port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in main_container(docs, component).get("ports", [])}
    return named[port]


def _ports_admit(docs: list[dict], component: str, ports: list[dict] | None, port: int) -> bool:
    """``port`` (a number on a pod of ``component``) is in a rule's ports (names resolve on that pod)."""
    if ports is None:
        return True
    named = {p["name"]: p["containerPort"] for p in main_container(docs, component).get("ports", [])}
    return any(named.get(p["port"], p["port"]) == port for p in ports)


def _in_release(peer: dict, labels: dict) -> bool:
    """Does a peer select a pod with ``labels`` in the release's namespace?"""
    if "ipBlock" in peer:
        return False
    ns = peer.get("namespaceSelector")
    if ns is not None and not ns.get("matchLabels", {}).items() <= {"kubernetes.io/metadata.name": "rl"}.items():
        return False
    return peer.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()


def _policies(docs: list[dict], component: str, direction: str) -> list[dict]:
    labels = workloads(docs)[component]["spec"]["template"]["metadata"]["labels"]
    return [
        p["spec"]
        for p in by_kind(docs, "NetworkPolicy").values()
        if direction in p["spec"]["policyTypes"] and p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    ]


def reaches(docs: list[dict], src: str, dst: str, port: int | str) -> bool:
    """A pod of component ``src`` connects to a pod of ``dst`` on ``port`` (name or number on ``dst``)."""
    number = _port_number(docs, dst, port)
    src_labels = workloads(docs)[src]["spec"]["template"]["metadata"]["labels"]
    dst_labels = workloads(docs)[dst]["spec"]["template"]["metadata"]["labels"]
    ingress = _policies(docs, dst, "Ingress")
    egress = _policies(docs, src, "Egress")
    ok_in = not ingress or any(
        (r.get("from") is None or any(_in_release(p, src_labels) for p in r["from"]))
        and _ports_admit(docs, dst, r.get("ports"), number)
        for spec in ingress
        for r in spec.get("ingress", [])
    )
    ok_out = not egress or any(
        (r.get("to") is None or any(_in_release(p, dst_labels) for p in r["to"]))
        and _ports_admit(docs, dst, r.get("ports"), number)
        for spec in egress
        for r in spec.get("egress", [])
    )
    return ok_in and ok_out


def admits_peer(docs: list[dict], dst: str, peer: dict, port: int) -> bool:
    """An outside peer, as written in the values (metricsFrom), reaches ``dst`` on port number ``port``."""
    ingress = _policies(docs, dst, "Ingress")
    return not ingress or any(
        (r.get("from") is None or peer in r["from"]) and _ports_admit(docs, dst, r.get("ports"), port)
        for spec in ingress
        for r in spec.get("ingress", [])
    )


# ---- networkPolicy.ncclWeightSync


def test_nccl_weight_sync_opens_all_ports_between_trainer_and_rollout_pods_and_among_pods():
    on = tools.render(sets=("networkPolicy.ncclWeightSync=true",))
    off = tools.render()
    validate(on, ("NetworkPolicy",))
    assert workloads(on)["rollout"]["spec"]["replicas"] >= 2  # pod-to-pod links exist only with several
    # NCCL's bootstrap and broadcast rings (gloo's full mesh too) link every rank to its neighbours: the
    # trainer's store and rank 0, each pod and the next pod, on ports nobody names in advance.
    for src, dst in (("trainer", "rollout"), ("rollout", "trainer"), ("rollout", "rollout")):
        assert reaches(on, src, dst, EPHEMERAL), (src, dst)
        assert not reaches(off, src, dst, EPHEMERAL), (src, dst)
    # ... and nothing else opens: weight sync stays the trainer's, the torchrun port the trainer nodes'.
    for src in ("gateway", "envs"):
        assert not reaches(on, src, "rollout", "grpc") and not reaches(on, src, "rollout", EPHEMERAL), src
        assert not reaches(on, src, "trainer", "torchrun") and not reaches(on, src, "trainer", EPHEMERAL), src
    assert not reaches(on, "rollout", "redis", "redis") and not reaches(on, "rollout", "envs", "http")
    assert reaches(off, "trainer", "rollout", "grpc") and reaches(off, "trainer", "rollout", "http")


def test_the_documented_collective_push_command_parses():
    """The trainer service pushes over gRPC; the docs name services.trainer.push for a collective push."""
    from molt.config import parse_settings
    from services.trainer.push import PushSettings

    text = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    assert "python -m services.trainer.push --transport nccl --collective_host <its pod IP>" in text
    pods = "molt-rollout-0.molt-rollout.rl.svc:50051,molt-rollout-1.molt-rollout.rl.svc:50051"
    argv = ["--model", "/checkpoints/final-hf", "--pods", pods, "--transport", "nccl", "--collective_host", "10.0.0.5"]
    s = parse_settings(PushSettings, argv, prog="services.trainer.push", environ={})
    assert s.transport == "nccl" and s.collective_host == "10.0.0.5"


# ---- networkPolicy.dnsTo


def test_dns_to_peers_are_the_only_dns_env_workers_reach(tmp_path):
    dns_to = [
        {"ipBlock": {"cidr": "169.254.20.10/32"}},  # NodeLocal DNSCache
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        },
    ]
    default_dns = yaml.safe_load((tools.CHART / "values.yaml").read_text())["networkPolicy"]["dnsTo"]
    cases = [(dns_to, render_with(tmp_path, {"networkPolicy": {"dnsTo": dns_to}})), (default_dns, tools.render())]
    for want, docs in cases:
        validate(docs, ("NetworkPolicy",))
        [spec] = _policies(docs, "envs", "Egress")
        dns = [r for r in spec["egress"] if any(p["port"] == 53 for p in r["ports"])]
        assert len(dns) == 1
        assert dns[0]["to"] == want
        assert sorted((p["port"], p["protocol"]) for p in dns[0]["ports"]) == [(53, "TCP"), (53, "UDP")]
        # every other rule names pods of this release only: no other resolver, no way out
        for rule in spec["egress"]:
            if rule is not dns[0]:
                assert rule["ports"] and all(p.keys() == {"podSelector"} for p in rule["to"]), rule
    # env workers reach the gateway by name, so a policy without a resolver would strand them
    args = " ".join(main_container(tools.render(), "envs")["args"])
    host = urlsplit(re.search(r"--gateway\.url=(\S+)", args)[1]).hostname
    with pytest.raises(ValueError):
        ipaddress.ip_address(host)
    out = tools.helm("template", "molt", str(tools.CHART), "--set-json", "networkPolicy.dnsTo=[]", check=False)
    assert out.returncode != 0 and "networkPolicy.dnsTo" in out.stderr
    off = ("--set-json", "networkPolicy.dnsTo=[]", "--set", "networkPolicy.enabled=false")
    assert tools.helm("template", "molt", str(tools.CHART), *off, check=False).returncode == 0


# ---- networkPolicy.metricsFrom


CUSTOM_METRICS_FROM = [
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
    {"ipBlock": {"cidr": "10.9.0.0/16"}},
]


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"networkPolicy": {"metricsFrom": CUSTOM_METRICS_FROM}},
        {"networkPolicy": {"metricsFrom": CUSTOM_METRICS_FROM, "gatewayFrom": [{"ipBlock": {"cidr": "10.1.0.0/16"}}]}},
    ],
    ids=["default", "custom", "custom-gateway-narrowed"],
)
def test_metrics_from_peers_reach_every_scraped_port_and_no_other(tmp_path, values):
    docs = render_with(tmp_path, values, api_versions=MONITORING)
    validate(docs, ("NetworkPolicy",))
    peers = (
        values.get("networkPolicy", {}).get("metricsFrom")
        or yaml.safe_load((tools.CHART / "values.yaml").read_text())["networkPolicy"]["metricsFrom"]
    )
    services = by_kind(docs, "Service")
    scraped: dict[str, int] = {}
    for sm in by_kind(docs, "ServiceMonitor").values():
        component = sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        selector = sm["spec"]["selector"]["matchLabels"].items()
        [svc] = [s for s in services.values() if selector <= s["metadata"]["labels"].items()]
        [endpoint] = sm["spec"]["endpoints"]
        [svc_port] = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
        scraped[component] = _port_number(docs, component, svc_port["targetPort"])
    assert set(scraped) == set(MOLT)
    for component in (*MOLT, "redis"):
        for p in main_container(docs, component)["ports"]:
            for peer in peers:
                want = scraped.get(component) == p["containerPort"]
                assert admits_peer(docs, component, peer, p["containerPort"]) == want, (component, p, peer)


# ---- redis.auth.existingSecret


def _secret_refs(docs: list[dict]) -> dict[tuple[str, str, str], dict]:
    """(workload, container, env name) -> secretKeyRef, over every container and init container."""
    refs = {}
    for kind in WORKLOADS:
        for name, w in by_kind(docs, kind).items():
            spec = w["spec"]["template"]["spec"]
            for c in spec["containers"] + spec.get("initContainers", []):
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        refs[(name, c["name"], e["name"])] = ref
    return refs


def test_redis_existing_secret_is_read_by_every_consumer_and_no_password_is_rendered():
    docs = tools.render(sets=("redis.auth.existingSecret=team-redis", "redis.auth.existingSecretKey=redis-password"))
    validate(docs, (*WORKLOADS, "Secret"))
    secrets = by_kind(docs, "Secret")
    assert "molt-redis" not in secrets
    for s in secrets.values():  # no Secret of the chart holds a Redis password
        keys = set(s.get("stringData", {})) | set(s.get("data", {}))
        assert not keys & {"password", "redis-password"}, s["metadata"]["name"]
    password_refs = {k: v for k, v in _secret_refs(docs).items() if k[2] == "REDIS_PASSWORD"}
    assert {k[0] for k in password_refs} == {"molt-redis", "molt-gateway", "molt-trainer"}
    assert all(ref == {"name": "team-redis", "key": "redis-password"} for ref in password_refs.values())
    missing = {ref["name"] for ref in _secret_refs(docs).values()} - set(secrets)
    assert missing == {"team-redis"}  # nothing else points at a Secret the chart does not render
    redis = main_container(docs, "redis")
    assert 'requirepass "$pass"' in redis["args"][0]  # on stdin, not argv
    for component in ("gateway", "trainer"):
        env = main_container(docs, component)["env"]
        names = [e["name"] for e in env]
        url = env[names.index("MOLT_REDIS__URL")]["value"]
        assert (
            url.startswith("redis://:$(REDIS_PASSWORD)@molt-redis.")
            and "value" not in env[names.index("REDIS_PASSWORD")]
        )
        assert names.index("REDIS_PASSWORD") < names.index("MOLT_REDIS__URL")  # else Kubernetes does not expand it
    # the default: the chart's own Secret, the same consumers
    default = _secret_refs(tools.render())
    assert {k[0] for k, v in default.items() if k[2] == "REDIS_PASSWORD" and v["name"] == "molt-redis"} == {
        "molt-redis",
        "molt-gateway",
        "molt-trainer",
    }


# ---- compose and chart agree


@pytest.fixture(scope="module")
def compose() -> dict:
    return tools.load_compose(COMPOSE_ENV)


@pytest.fixture(scope="module")
def chart() -> list[dict]:
    return tools.render()


def test_compose_env_workers_may_run_tool_sandboxes_as_the_charts_env_worker_recipe(compose):
    """bubblewrap unshares namespaces and mounts in them: Docker's default seccomp and AppArmor profiles
    refuse that. Compose unconfines the env worker alone, as the chart's documented recipe does (seccomp
    Unconfined, the AppArmor annotation), and keeps the pod's other limits."""
    envs = compose["services"]["envs"]
    opts = set(envs["security_opt"])
    assert {"seccomp=unconfined", "apparmor=unconfined", "no-new-privileges:true"} <= opts
    assert envs["cap_drop"] == ["ALL"]
    for name, svc in compose["services"].items():
        if name != "envs":
            assert not any("unconfined" in o for o in svc.get("security_opt", [])), name
    docs = tools.render("ci/multinode-trainer-values.yaml")  # the value set whose agents run tool code
    validate([workloads(docs)["envs"]], WORKLOADS)
    pod = workloads(docs)["envs"]["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    assert (
        pod["metadata"]["annotations"][f"container.apparmor.security.beta.kubernetes.io/{c['name']}"] == "unconfined"
    )
    assert APPARMOR_ENVS.endswith("/" + c["name"])  # the documented annotation names this container
    assert c["securityContext"]["allowPrivilegeEscalation"] is False  # = no-new-privileges
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # = cap_drop: [ALL]
    for component in ("rollout", "gateway", "trainer"):
        assert workloads(docs)[component]["spec"]["template"]["spec"]["securityContext"]["seccompProfile"] == {
            "type": "RuntimeDefault"
        }
    text = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    assert APPARMOR_ENVS in text and "envs.seccompProfile: {type: Unconfined}" in text
    assert "security_opt: [seccomp=unconfined, apparmor=unconfined, no-new-privileges:true]" in text


def _molt_env(env) -> set[str]:
    names = env if isinstance(env, dict) else [e["name"] for e in env]
    return {n for n in names if n.startswith("MOLT_")}


def test_compose_and_chart_give_each_service_the_same_molt_variables(compose, chart):
    """Credentials and settings that travel in the environment reach the same services either way."""
    for component in MOLT:
        from_compose = _molt_env(compose["services"][component].get("environment", {}))
        from_chart = _molt_env(main_container(chart, component).get("env", []))
        from_chart.discard("MOLT_VLLM__SEED")  # each pod's own engine seed: compose runs one rollout pod
        assert from_compose == from_chart, component


def _flag_values(argv: list[str], *flags: str) -> dict[str, str]:
    return {f: argv[argv.index(f) + 1] for f in flags}


def test_compose_and_chart_run_redis_alike(compose, chart):
    redis = compose["services"]["redis"]
    c = main_container(chart, "redis")
    assert redis["image"] == c["image"]
    flags = ("--appendonly", "--appendfsync", "--maxmemory-policy")
    assert _flag_values(redis["command"], *flags) == _flag_values(c["args"], *flags)
    assert redis["command"][2] == c["args"][0]  # the same script: requirepass on stdin, not argv
    assert redis["environment"]["REDIS_PASSWORD"] == COMPOSE_ENV["MOLT_REDIS_PASSWORD"]
    assert redis["environment"]["REDISCLI_AUTH"] and any(e["name"] == "REDISCLI_AUTH" for e in c["env"])


def test_compose_and_chart_keep_the_model_alike(compose, chart):
    def ckpt(argv):
        return sorted(a for a in argv if a.startswith("--ckpt."))

    assert ckpt(compose["services"]["trainer"]["command"]) == ckpt(main_container(chart, "trainer")["args"])


def test_compose_and_chart_serve_on_the_same_ports(compose, chart):
    def port_flags(argv):
        return dict(a.split("=", 1) for a in argv if re.match(r"--(server|grpc|metrics)\.port=", a))

    for component in MOLT:
        from_compose = port_flags(compose["services"][component]["command"])
        from_chart = port_flags(main_container(chart, component)["args"])
        assert from_compose and from_compose == from_chart, component
        exposed = {str(p["containerPort"]) for p in main_container(chart, component)["ports"]}
        assert set(from_chart.values()) <= exposed, component

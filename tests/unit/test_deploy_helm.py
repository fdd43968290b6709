"""The Helm chart, rendered for real: `helm lint` + `helm template` for three value sets, every
manifest validated with kubernetes-validate (core kinds) or a small schema of ours (the Prometheus
Operator CRDs ServiceMonitor and PrometheusRule, which kubernetes-validate does not ship), and the
wiring a cluster needs: per-pod rollout URLs, multi-node torchrun, Redis modes, Secrets, selectors.
Container command lines are parsed with each service's own settings model where it exists."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest

ROOT = Path(__file__).resolve().parents[2]


from deploy import tools  # noqa: E402

VALUE_SETS = {
    "default": {"values": (), "api_versions": ("monitoring.coreos.com/v1",)},
    "external-redis": {"values": ("ci/external-redis-values.yaml",)},
    "multinode-trainer": {"values": ("ci/multinode-trainer-values.yaml",)},
}
K8S_VERSIONS = ("1.28.0", "1.37.0")  # the chart's kubeVersion floor and the newest schema here
WORKLOADS = ("Deployment", "StatefulSet")
SECRETS_OUTSIDE_CHART = {"external-redis": {"molt-redis-url", "molt-gateway-keys"}}
# Env the chart sets ahead of the service reading it; checked for real once the field exists.
# MOLT_WEIGHTS_TOKEN: read by the weight-sync code (services/rollout, the trainer's pusher) itself;
# MOLT_INTERNAL_TOKEN: read by molt/auth.py in every service that checks or sends it (never a setting).
PENDING_ENV: set[tuple[str, str]] = {
    ("rollout", "MOLT_WEIGHTS_TOKEN"),
    ("trainer", "MOLT_WEIGHTS_TOKEN"),
    *((service, "MOLT_INTERNAL_TOKEN") for service in ("rollout", "envs", "gateway", "trainer")),
}
# Flags (Molt's names) the chart passes ahead of the service accepting them: dropped before parsing
# only while the settings model lacks the field, parsed for real once it exists.
PENDING_FLAGS: set[tuple[str, str]] = set()

# kubernetes-validate has schemas for core kinds only; the Prometheus Operator kinds the chart
# renders are checked against small strict schemas of ours (deploy/k8s/schemas/*.json).
CRD_SCHEMAS = {
    kind: json.loads((ROOT / "deploy" / "k8s" / "schemas" / f"{kind.lower()}.json").read_text())
    for kind in ("ServiceMonitor", "PrometheusRule")
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {
        name: tools.render(*vs["values"], api_versions=vs.get("api_versions", ())) for name, vs in VALUE_SETS.items()
    }


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(docs: list[dict], name: str) -> dict:
    for kind in WORKLOADS:
        if name in by_kind(docs, kind):
            return by_kind(docs, kind)[name]["spec"]["template"]["spec"]["containers"][0]
    raise KeyError(name)


def flag(c: dict, name: str) -> str:
    hits = [a.split("=", 1)[1] for a in c["args"] if a.startswith(name + "=")]
    assert len(hits) == 1, f"{name} in {c['args']}"
    return hits[0]


def list_flag(c: dict, name: str) -> list[str]:
    """Values of a list flag given as ``--name V1 V2 ...``."""
    args = c["args"]
    i = args.index(name) + 1
    values = []
    while i < len(args) and not args[i].startswith("--"):
        values.append(args[i])
        i += 1
    return values


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint(name):
    args = ["lint", "--strict", str(tools.CHART), "-n", "rl"]
    for v in VALUE_SETS[name]["values"]:
        args += ["-f", str(tools.CHART / v)]
    out = tools.helm(*args, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name", VALUE_SETS)
def test_manifests_validate(rendered, name):
    kinds = set()
    for doc in rendered[name]:
        kinds.add(doc["kind"])
        if doc["kind"] in CRD_SCHEMAS:
            jsonschema.Draft202012Validator(CRD_SCHEMAS[doc["kind"]]).validate(doc)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}): {exc.message} at {exc.path}")
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap"} <= kinds


def test_rollout_pods_gpu_readiness_and_urls(rendered):
    for name, docs in rendered.items():
        sts = by_kind(docs, "StatefulSet")["molt-rollout"]
        svc = by_kind(docs, "Service")[sts["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None"
        c = sts["spec"]["template"]["spec"]["containers"][0]
        gpus = c["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == c["resources"]["requests"]["nvidia.com/gpu"] >= 1
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        replicas = sts["spec"]["replicas"]
        want = [f"http://molt-rollout-{i}.molt-rollout.rl.svc.cluster.local:8000" for i in range(replicas)]
        assert list_flag(container(docs, "molt-gateway"), "--rollout.urls") == want, name
        assert list_flag(container(docs, "molt-trainer"), "--rollout.urls") == want, name
    multi = by_kind(rendered["multinode-trainer"], "StatefulSet")["molt-rollout"]
    assert multi["spec"]["replicas"] == 8
    assert multi["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_trainer_runs_multinode_torchrun_over_headless_service(rendered):
    sts = by_kind(rendered["multinode-trainer"], "StatefulSet")["molt-trainer"]
    svc = by_kind(rendered["multinode-trainer"], "Service")[sts["spec"]["serviceName"]]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["replicas"] == 4 and sts["spec"]["podManagementPolicy"] == "Parallel"
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["torchrun"]
    args = c["args"]
    assert "--nnodes=4" in args and "--nproc-per-node=8" in args
    # c10d rendezvous on pod 0's stable name: a restarted node (pod 0 included) rejoins the same endpoint,
    # and each node names itself by its stable name, so the sorted names put global rank 0 on pod 0.
    assert "--rdzv-backend=c10d" in args and "--rdzv-id=molt" in args
    assert "--rdzv-endpoint=molt-trainer-0.molt-trainer.rl.svc.cluster.local:29500" in args
    assert "--local-addr=$(POD_NAME).molt-trainer.rl.svc.cluster.local" in args
    assert int(flag(c, "--max-restarts")) > 0
    assert not any(a.startswith(("--master-addr", "--node-rank")) for a in args)
    assert min(f"molt-trainer-{i}.molt-trainer" for i in range(12)) == "molt-trainer-0.molt-trainer"
    assert args[args.index("-m") + 1] == "services.trainer"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "--ckpt.load_enable" in args  # an RWX checkpoint claim makes restarts resume
    init = sts["spec"]["template"]["spec"]["initContainers"][0]  # waits for every rollout pod's /readyz
    assert init["args"] == [f"http://molt-rollout-{i}.molt-rollout.rl.svc.cluster.local:8000" for i in range(8)]
    sm = by_kind(rendered["multinode-trainer"], "ServiceMonitor")["molt-trainer"]["spec"]["endpoints"][0]
    assert sm["relabelings"] == [
        {"sourceLabels": ["__meta_kubernetes_pod_label_apps_kubernetes_io_pod_index"], "regex": "0", "action": "keep"}
    ]  # only rank 0 serves /metrics
    single = container(rendered["default"], "molt-trainer")["args"]
    assert "--standalone" in single and not any(a.startswith("--nnodes") for a in single)


def test_redis_in_chart_or_external(rendered):
    def redis_env(docs, workload):
        return next(e for e in container(docs, workload)["env"] if e["name"] == "MOLT_REDIS__URL")

    default = rendered["default"]
    assert "molt-redis" in by_kind(default, "StatefulSet") and "molt-redis" in by_kind(default, "Service")
    for w in ("molt-gateway", "molt-trainer"):  # the password comes from the Secret, expanded by Kubernetes
        assert redis_env(default, w)["value"] == "redis://:$(REDIS_PASSWORD)@molt-redis.rl.svc.cluster.local:6379/0"
        env = container(default, w)["env"]
        names = [e["name"] for e in env]
        assert names.index("REDIS_PASSWORD") < names.index("MOLT_REDIS__URL")  # defined first, or no expansion
        assert env[names.index("REDIS_PASSWORD")]["valueFrom"]["secretKeyRef"] == {
            "name": "molt-redis",
            "key": "password",
        }
    ext = rendered["external-redis"]
    assert not [d for d in ext if d["metadata"]["name"] == "molt-redis"]
    ref = redis_env(ext, "molt-gateway")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "molt-redis-url", "key": "url"}
    # redis.external.url (with a password) reaches the pods through the chart's Secret, not the pod spec
    multi = rendered["multinode-trainer"]
    ref = redis_env(multi, "molt-trainer")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "molt-redis-external", "key": "url"}
    assert by_kind(multi, "Secret")["molt-redis-external"]["stringData"]["url"].startswith("redis://:secret@")


def test_secret_refs_resolve(rendered):
    for name, docs in rendered.items():
        secrets = by_kind(docs, "Secret")
        outside = SECRETS_OUTSIDE_CHART.get(name, set())
        for kind in WORKLOADS:
            for w in by_kind(docs, kind).values():
                for c in w["spec"]["template"]["spec"]["containers"]:
                    for e in c.get("env", []):
                        ref = e.get("valueFrom", {}).get("secretKeyRef")
                        if not ref:
                            continue
                        # a missing key must stop the pod, not start it without the credential
                        assert not ref.get("optional"), f"{name}: {w['metadata']['name']} {e['name']} is optional"
                        if ref["name"] in outside:
                            continue
                        assert ref["name"] in secrets, f"{name}: {w['metadata']['name']} needs Secret {ref['name']}"
                        assert ref["key"] in secrets[ref["name"]]["stringData"]
    keys = by_kind(rendered["multinode-trainer"], "Secret")["molt-api-keys"]["stringData"]
    assert keys == {
        "MOLT_AUTH__API_KEYS": "sk-molt-ci-0123456789abcdef,sk-molt-ci-fedcba9876543210",
        "MOLT_GATEWAY__API_KEY": "sk-molt-ci-0123456789abcdef",
    }
    # env workers open sessions with MOLT_GATEWAY__API_KEY, from the generated Secret or the user's
    for name, secret in (("default", "molt-api-keys"), ("external-redis", "molt-gateway-keys")):
        env = {e["name"]: e for e in container(rendered[name], "molt-envs")["env"]}
        assert env["MOLT_GATEWAY__API_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": secret,
            "key": "MOLT_GATEWAY__API_KEY",
        }, name
    generated = by_kind(rendered["default"], "Secret")["molt-api-keys"]["stringData"]
    assert generated["MOLT_GATEWAY__API_KEY"] in generated["MOLT_AUTH__API_KEYS"].split(",")


def test_selectors_ports_and_scale_targets_match(rendered):
    for name, docs in rendered.items():
        pods = [
            (w["spec"]["template"]["metadata"]["labels"], w["spec"]["template"]["spec"]["containers"])
            for kind in WORKLOADS
            for w in by_kind(docs, kind).values()
        ]
        services = by_kind(docs, "Service")
        for svc in services.values():
            sel = svc["spec"]["selector"]
            matches = [cs for labels, cs in pods if sel.items() <= labels.items()]
            assert matches, f"{name}: Service {svc['metadata']['name']} selects no pod"
            port_names = {p["name"] for c in matches[0] for p in c.get("ports", [])}
            for p in svc["spec"]["ports"]:
                assert p["targetPort"] in port_names, f"{name}: {svc['metadata']['name']} port {p['targetPort']}"
        for sm in by_kind(docs, "ServiceMonitor").values():
            hits = [
                s
                for s in services.values()
                if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
            ]
            assert len(hits) == 1, f"{name}: ServiceMonitor {sm['metadata']['name']}"
            assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in hits[0]["spec"]["ports"]}
            # Kubernetes' own `pod`/`namespace` win: no Molt series may clobber them
            # (test_no_series_label_is_a_target_label)
            assert not any(e["honorLabels"] for e in sm["spec"]["endpoints"])
        for hpa in by_kind(docs, "HorizontalPodAutoscaler").values():
            ref = hpa["spec"]["scaleTargetRef"]
            assert ref["name"] in by_kind(docs, ref["kind"])
            assert "replicas" not in by_kind(docs, ref["kind"])[ref["name"]]["spec"]  # the HPA owns it


def test_gateway_replicas_route_sessions_to_their_owner(rendered):
    """Several gateway replicas share one Service: each names itself in its session ids (its pod IP), the
    Service keeps a client on one replica for longer than a session may sit idle, and a replica that is
    stopped or scaled away drains its open sessions first."""
    from services.gateway.config import SessionConfig

    for name, docs in rendered.items():
        c = container(docs, "molt-gateway")
        assert flag(c, "--replica.public_url") == f"http://$(POD_IP):{flag(c, '--server.port')}", name
        [pod_ip] = [e for e in c["env"] if e["name"] == "POD_IP"]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        spec = by_kind(docs, "Service")["molt-gateway"]["spec"]
        assert spec["sessionAffinity"] == "ClientIP"
        assert spec["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] > SessionConfig().idle_ttl_s
        # scaling down takes the open episodes of a replica with it: only slowly
        drain = float(flag(c, "--session.drain_s"))
        pod_spec = by_kind(docs, "Deployment")["molt-gateway"]["spec"]["template"]["spec"]
        assert drain > 0 and pod_spec["terminationGracePeriodSeconds"] > drain  # the drain ends before the kill
        hpa = by_kind(docs, "HorizontalPodAutoscaler").get("molt-gateway")
        if hpa is not None:
            down = hpa["spec"]["behavior"]["scaleDown"]
            assert down["stabilizationWindowSeconds"] >= SessionConfig().idle_ttl_s
            assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 600}]
    assert "molt-gateway" in by_kind(rendered["default"], "HorizontalPodAutoscaler")


def test_env_workers_are_killed_only_after_their_running_episodes_could_end(rendered):
    """A stopped worker lets its running episodes finish, up to the episode timeout plus 5 s: the pod's
    termination grace period follows the timeout the chart passes."""
    for values, docs in [*rendered.items(), ("1800 s", tools.render(sets=("envs.episodeTimeoutSeconds=1800",)))]:
        timeout = float(flag(container(docs, "molt-envs"), "--envs.episode_timeout_s"))
        spec = by_kind(docs, "Deployment")["molt-envs"]["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] > timeout + 5, values
    assert timeout == 1800


def test_env_workers_are_restarted_for_a_stuck_loop_only_once_their_sessions_are_closed(rendered):
    """A stuck event loop fails /healthz and stops the lease renewals alike: the liveness probe may restart the
    worker only after the gateway has closed its sessions (the lease plus the reaper's period), and not much
    later. The chart passes its one lease value as the flag; a second one beside it, or a lease over the
    gateway's idle TTL (every session open would be refused), does not render."""
    from services.envs.config import WorkerConfig
    from services.gateway.config import SessionConfig

    reaper_s = 5  # the gateway reaps lapsed leases at most this often (lifecycle.reap_loop)
    leases = {WorkerConfig().session_lease_s: rendered["default"]}  # the chart's default is the worker's
    for lease in (7, 300):
        leases[lease] = tools.render(sets=(f"envs.sessionLeaseSeconds={lease}",))
    for lease, docs in leases.items():
        c = container(docs, "molt-envs")
        live, lease_s = c["livenessProbe"], float(flag(c, "--envs.session_lease_s"))
        assert lease_s == lease
        # The restart comes after failureThreshold failures; the first may come at once, each takes up to 1 s.
        earliest = (live["failureThreshold"] - 1) * live["periodSeconds"] + live.get("timeoutSeconds", 1)
        assert lease_s + reaper_s <= earliest < lease_s + reaper_s + 2 * live["periodSeconds"], (lease, live)
    ttl = int(SessionConfig().idle_ttl_s)
    assert tools.render(sets=(f"envs.sessionLeaseSeconds={ttl}",))
    for sets, message in [
        ((f"envs.sessionLeaseSeconds={ttl + 1}",), f"--session.idle_ttl_s is {ttl}"),
        ((f"envs.sessionLeaseSeconds={ttl + 1}", "gateway.extraArgs={--session.idle_ttl_s=60}"), "is 60:"),
        (("envs.extraArgs={--envs.session_lease_s=30}",), "envs.sessionLeaseSeconds"),
        (("envs.extraEnv[0].name=MOLT_ENVS__SESSION_LEASE_S", "envs.extraEnv[0].value=x"), "sessionLeaseSeconds"),
    ]:
        out = tools.helm("template", "molt", str(tools.CHART), *(a for s in sets for a in ("--set", s)), check=False)
        assert out.returncode != 0 and message in out.stderr, (sets, out.stderr)
    longer = ("envs.sessionLeaseSeconds=3000", "gateway.extraArgs={--session.idle_ttl_s=3600}")
    assert flag(container(tools.render(sets=longer), "molt-envs"), "--envs.session_lease_s") == "3000"
    by_env = ["--set", "envs.sessionLeaseSeconds=3000", "--set", "gateway.extraEnv[0].name=MOLT_SESSION__IDLE_TTL_S"]
    out = tools.helm("template", "molt", str(tools.CHART), *by_env, "--set-string", "gateway.extraEnv[0].value=3600")
    assert "--envs.session_lease_s=3000" in out.stdout


def test_ipv6_cluster_listens_on_both_families_and_names_replicas_by_bracketed_ip():
    """On an IPv6 cluster $(POD_IP) expands to a bare address: the processes listen on "::", and the gateway
    brackets its public URL (services/gateway/config.py), so its session ids name a reachable URL."""
    from services.gateway.config import GatewaySettings

    docs = tools.render(sets=("listenAddress=::",))
    for name in ("molt-gateway", "molt-rollout", "molt-trainer"):
        env = {e["name"]: e.get("value") for e in container(docs, name)["env"]}
        assert env["MOLT_SERVER__HOST"] == "::", name
    c = container(docs, "molt-gateway")
    url = flag(c, "--replica.public_url").replace("$(POD_IP)", "fd00:10:244::7")
    settings = GatewaySettings.model_validate(
        {"model": {"path": "m"}, "server": {"host": "::"}, "auth": {"api_keys": ["k"]}, "replica": {"public_url": url}}
    )
    assert settings.replica.public_url == f"http://[fd00:10:244::7]:{flag(c, '--server.port')}"
    out = tools.helm("template", "molt", str(tools.CHART), "--set", "listenAddress=::1", check=False)
    assert out.returncode != 0 and "listenAddress" in out.stderr


def test_monitoring_objects_follow_the_crds(rendered):
    def kinds(docs):
        return {d["kind"] for d in docs}

    assert {"ServiceMonitor", "PrometheusRule"} <= kinds(rendered["default"])  # auto + CRDs served
    assert not {"ServiceMonitor", "PrometheusRule"} & kinds(tools.render())  # auto, no CRDs
    assert not {"ServiceMonitor", "PrometheusRule"} & kinds(rendered["external-redis"])  # disabled
    assert len(by_kind(rendered["multinode-trainer"], "ServiceMonitor")) == 4
    dash = by_kind(rendered["default"], "ConfigMap")["molt-dashboard"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (tools.CHART / "dashboards" / "molt-overview.json").read_text()
    assert dash["data"]["molt-overview.json"].strip() == shipped.strip()


def test_env_workers_scale_on_cpu_and_trajectory_deficit(rendered):
    hpa = by_kind(rendered["multinode-trainer"], "HorizontalPodAutoscaler")["molt-envs"]
    types = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert types["Resource"]["resource"]["name"] == "cpu"
    assert types["External"]["external"]["metric"]["name"] == "molt_trajectory_deficit_entries"
    rule = by_kind(rendered["multinode-trainer"], "PrometheusRule")["molt-alerts"]
    records = [r for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r]
    assert records and records[0]["labels"] == {"namespace": "rl"}
    default_hpa = by_kind(rendered["default"], "HorizontalPodAutoscaler")["molt-envs"]
    assert [m["type"] for m in default_hpa["spec"]["metrics"]] == ["Resource"]


@pytest.mark.parametrize(
    "sets, message",
    [
        (("redis.enabled=false",), "redis.external.url"),
        (("rollout.replicas=0",), "/rollout/replicas"),
        (("trainer.gpus=8",), "trainer"),
        (("envs.agents.math=math.txt",), "/envs/agents/math"),
    ],
)
def test_bad_values_fail_with_the_fix_in_the_message(sets, message):
    args = ["template", "molt", str(tools.CHART)]
    for s in sets:
        args += ["--set", s]
    out = tools.helm(*args, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def _stand_in(env: dict) -> str:
    """A value of the form the variable takes, for one the chart fills from a Secret or the pod: the services
    check a URL's form when they parse it."""
    field = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
    if "pod-index" in field:
        return "0"
    return (
        "redis://:sk-test-0123456789abcdef@redis:6379/0"
        if env["name"] == "MOLT_REDIS__URL"
        else "sk-test-0123456789abcdef"
    )


@pytest.mark.parametrize("name", VALUE_SETS)
def test_container_commands_parse_with_the_service_settings(rendered, name, tmp_path):
    """Every flag and MOLT_* variable the chart gives a service is one the service accepts."""
    from molt.config import iter_fields

    checked = 0
    for kind in WORKLOADS:
        for w in by_kind(rendered[name], kind).values():
            c = w["spec"]["template"]["spec"]["containers"][0]
            cmd = c.get("command", []) + c.get("args", [])
            if "services." not in " ".join(cmd):
                continue
            service, argv = tools.service_argv(cmd)
            # a value the cluster fills in: a pod index (a number) or a secret (a token)
            env = {e["name"]: e.get("value", _stand_in(e)) for e in c.get("env", [])}
            found = tools.settings_model(service)
            if found is None:
                continue
            known = {"MOLT_" + d.upper().replace(".", "__") for d, _, _ in iter_fields(found[0])}
            for var in sorted(k for k in env if k.startswith("MOLT_")):
                if (service, var) in PENDING_ENV and var not in known:
                    continue
                assert var in known, f"{w['metadata']['name']}: services.{service} has no setting for {var}"
            fields = {d for d, _, _ in iter_fields(found[0])}
            argv = [
                a
                for a in argv
                if not ((service, a[2:].split("=", 1)[0]) in PENDING_FLAGS and a[2:].split("=", 1)[0] not in fields)
            ]
            settings = tools.parse_service(service, argv, env, agent_dir=tmp_path)
            if service in ("gateway", "trainer"):  # one URL per rollout pod, as the service sees them
                pods = by_kind(rendered[name], "StatefulSet")["molt-rollout"]["spec"]["replicas"]
                assert len(settings.rollout.urls) == pods, settings.rollout.urls
            checked += 1
    if not checked:
        pytest.skip("no service settings module importable yet")


def test_crd_schemas_are_strict(rendered):
    import copy

    for schema in CRD_SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    rule = copy.deepcopy(next(d for d in rendered["default"] if d["kind"] == "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["fore"] = "5m"
    monitor = copy.deepcopy(next(d for d in rendered["default"] if d["kind"] == "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["honorLabel"] = True
    for doc in (rule, monitor):
        assert list(jsonschema.Draft202012Validator(CRD_SCHEMAS[doc["kind"]]).iter_errors(doc)), doc["kind"]


def test_a_stopped_trainer_has_time_to_finish_its_step_and_save():
    """SIGTERM reaches torchrun, which passes it on to the ranks (they finish the step, save, ack) but
    SIGKILLs them after --shutdown-timeout (30 s by default): the chart sets it inside the pod's grace period,
    which follows trainer.stopGraceSeconds; compose sets both the same way."""
    for grace, docs in [(300, tools.render()), (900, tools.render(sets=("trainer.stopGraceSeconds=900",)))]:
        spec = by_kind(docs, "StatefulSet")["molt-trainer"]["spec"]["template"]["spec"]
        args = spec["containers"][0]["args"]
        [timeout] = [int(a.split("=", 1)[1]) for a in args if a.startswith("--shutdown-timeout=")]
        assert spec["terminationGracePeriodSeconds"] == grace and 30 < timeout < grace
        assert args.index(f"--shutdown-timeout={timeout}") < args.index("-m")  # torchrun's flag, not the trainer's
    import yaml

    trainer = yaml.safe_load((tools.ROOT / "docker-compose.yml").read_text())["services"]["trainer"]
    [timeout] = [int(a.split("=", 1)[1]) for a in trainer["command"] if a.startswith("--shutdown-timeout=")]
    assert trainer["command"][0] == "torchrun" and 30 < timeout < int(trainer["stop_grace_period"].rstrip("s"))


def test_the_trainer_logs_to_wandb_with_its_key_from_a_secret(tmp_path):
    """docs/deploy.md's W&B recipe: the key reaches the trainer from a Secret as MOLT_LOGGER__WANDB__KEY (never a
    flag, so never in `ps` or the pod spec), the project through trainer.extraArgs; the trainer reads both."""
    import yaml

    from molt.config import mask_secrets

    values = tmp_path / "wandb.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "extraEnv": [
                        {
                            "name": "MOLT_LOGGER__WANDB__KEY",
                            "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}},
                        }
                    ],
                    "extraArgs": ["--logger.wandb.project=rl-runs"],
                }
            }
        )
    )
    docs = tools.render(str(values))
    c = container(docs, "molt-trainer")
    [key] = [e for e in c["env"] if e["name"] == "MOLT_LOGGER__WANDB__KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "wandb", "key": "api-key"}
    service, argv = tools.service_argv([c.get("command", [""])[0], *c["args"]])
    settings = tools.parse_service(service, argv, {"MOLT_LOGGER__WANDB__KEY": "secret-value"})
    assert settings.logger.wandb.key == "secret-value" and settings.logger.wandb.project == "rl-runs"
    assert "secret-value" not in str(mask_secrets(settings.model_dump()))


def test_each_rollout_pod_seeds_its_engine_with_its_index(tmp_path):
    """As Molt seeds engine i with seed + i: the chart gives each pod its StatefulSet index as MOLT_VLLM__SEED,
    which the pod's settings read (a --vllm.seed flag would win); the local stack gives pod i base + i."""
    from molt.stack.services import pod_seed_args

    c = container(tools.render(), "molt-rollout")
    [seed] = [e for e in c["env"] if e["name"] == "MOLT_VLLM__SEED"]
    assert seed["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    service, argv = tools.service_argv(c["command"] + c["args"])
    assert tools.parse_service(service, argv, {"MOLT_VLLM__SEED": "3"}).vllm.seed == 3
    assert pod_seed_args(["--vllm.enforce_eager"], 2) == ["--vllm.enforce_eager", "--vllm.seed", "2"]
    assert pod_seed_args(["--vllm.seed", "10", "--x"], 1) == ["--x", "--vllm.seed", "11"]
    assert pod_seed_args(["--vllm.seed=10"], 0) == ["--vllm.seed", "10"]


def test_the_service_token_reaches_who_checks_and_who_sends_it_from_one_secret(rendered):
    """values.yaml internalToken: rollout pods and env workers check MOLT_INTERNAL_TOKEN, the gateway and the
    trainer send it; one Secret, generated once and kept (helm.sh/resource-policy: keep), or one named."""
    users = ("molt-rollout", "molt-envs", "molt-gateway", "molt-trainer")
    for name, docs in rendered.items():
        refs = {
            w: {e["name"]: e for e in container(docs, w)["env"]}["MOLT_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]
            for w in users
        }
        assert all(r == {"name": "molt-internal", "key": "MOLT_INTERNAL_TOKEN"} for r in refs.values()), name
        secret = by_kind(docs, "Secret")["molt-internal"]
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        token = secret["stringData"]["MOLT_INTERNAL_TOKEN"]
        assert len(token) >= 32 and token.isalnum()
        weights = by_kind(docs, "Secret")["molt-weights"]["stringData"]["MOLT_WEIGHTS_TOKEN"]
        assert token != weights  # two credentials: the gateway holds this one, never the weight-sync one
        others = [w for kind in WORKLOADS for n, w in by_kind(docs, kind).items() if n not in users]
        assert not any("MOLT_INTERNAL_TOKEN" in json.dumps(w) for w in others), name  # nobody else
    ext = tools.render(sets=("internalToken.existingSecret=my-service-token",))
    assert "molt-internal" not in by_kind(ext, "Secret")
    for w in users:
        env = {e["name"]: e for e in container(ext, w)["env"]}
        assert env["MOLT_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "my-service-token", w


def test_every_workload_pulls_through_the_registry_and_secrets_it_is_given():
    """imageRegistry and imagePullSecrets reach every pod, the in-chart Redis too (an air-gapped cluster has no
    Docker Hub); without a registry Redis stays the official redis:7.4-alpine."""
    docs = tools.render(sets=("imageRegistry=registry.internal:5000/mirror", "imagePullSecrets[0].name=pull"))
    pods = {n: w["spec"]["template"]["spec"] for kind in WORKLOADS for n, w in by_kind(docs, kind).items()}
    assert {"molt-redis", "molt-rollout", "molt-gateway", "molt-envs", "molt-trainer"} <= set(pods)
    for name, spec in pods.items():
        assert spec.get("imagePullSecrets") == [{"name": "pull"}], name
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["image"].startswith("registry.internal:5000/mirror/"), (name, c["image"])
    assert pods["molt-redis"]["containers"][0]["image"] == "registry.internal:5000/mirror/redis:7.4-alpine"
    assert container(tools.render(), "molt-redis")["image"] == "redis:7.4-alpine"


def test_without_the_charts_rollout_pods_the_gateway_is_told_where_they_are(tmp_path):
    """rollout.enabled=false: the chart's pod URLs would name pods that do not exist (the gateway never turns
    Ready), so it refuses to render until gateway.rolloutUrls names the pods; those reach --rollout.urls."""
    out = tools.helm("template", "molt", str(tools.CHART), "--set", "rollout.enabled=false", check=False)
    assert out.returncode != 0 and "gateway.rolloutUrls" in out.stderr
    urls = ["http://vllm-0.vllm.rl.svc:8000", "http://vllm-1.vllm.rl.svc:8000"]
    docs = tools.render(sets=("rollout.enabled=false", f"gateway.rolloutUrls={{{','.join(urls)}}}"))
    assert "molt-rollout" not in by_kind(docs, "StatefulSet")
    gateway = container(docs, "molt-gateway")
    assert list_flag(gateway, "--rollout.urls") == urls
    service, argv = tools.service_argv(gateway["command"] + gateway["args"])
    env = {e["name"]: e.get("value", _stand_in(e)) for e in gateway["env"]}
    assert [str(u) for u in tools.parse_service(service, argv, env).rollout.urls] == urls
    assert tools.render(sets=("rollout.enabled=false", "gateway.enabled=false"))  # no gateway: nothing to name
    both = tools.helm("template", "molt", str(tools.CHART), "--set", f"gateway.rolloutUrls={{{urls[0]}}}", check=False)
    assert both.returncode != 0 and "gateway.rolloutUrls" in both.stderr  # never silently ignored


@pytest.mark.parametrize("form", ["equals", "next-item"])
def test_tensor_parallel_size_must_match_the_gpus_per_pod(form, tmp_path):
    """vLLM needs exactly tensor_parallel_size GPUs per engine: a mismatch would render and fail only at engine
    start, so the chart refuses it, naming both values; a match renders and the pod's settings read it."""
    import yaml

    def values(gpus: int, tp: int) -> str:
        args = [f"--vllm.tensor_parallel_size={tp}"] if form == "equals" else ["--vllm.tensor_parallel_size", str(tp)]
        path = tmp_path / f"tp-{gpus}-{tp}.yaml"
        rollout = {"gpusPerPod": gpus, "extraArgs": ["--vllm.enforce_eager", *args]}
        path.write_text(yaml.safe_dump({"rollout": rollout}))
        return str(path)

    for gpus, tp in ((1, 2), (4, 2)):
        out = tools.helm("template", "molt", str(tools.CHART), "-f", values(gpus, tp), check=False)
        assert out.returncode != 0, (gpus, tp)
        assert "--vllm.tensor_parallel_size" in out.stderr and "rollout.gpusPerPod" in out.stderr
        assert f"={tp} " in out.stderr and f"is {gpus}:" in out.stderr
    c = container(tools.render(values(2, 2)), "molt-rollout")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    service, argv = tools.service_argv(c["command"] + c["args"])
    assert tools.parse_service(service, argv, {}).vllm.tensor_parallel_size == 2

"""The chart keeps the model, guards weights and data, and is hardened; rendered for real with Helm.

- Checkpoints: the trainer saves on a schedule and at the end to a PVC (never emptyDir), resumes on any
  restart, exports HF directories; rollout pods can start from the newest export (the pick script runs).
- Credentials: the weight-sync token reaches rollout pods and the trainer from one Secret; Redis requires
  a password every client gets from the environment; NetworkPolicies are evaluated for who reaches what.
- Hardening: non-root, read-only root filesystems, no capabilities, ServiceAccounts without tokens, PDBs,
  trainer probes (the probe script is run against a local HTTP server).
- NOTES.txt: every Secret key, Service/pod port and URL path it names exists in the chart or the service.
"""

from __future__ import annotations

import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from deploy import tools

ROOT = Path(__file__).resolve().parents[2]
VALUE_SETS = {
    "default": (),
    "external-redis": ("ci/external-redis-values.yaml",),
    "multinode-trainer": ("ci/multinode-trainer-values.yaml",),
}
WORKLOADS = ("Deployment", "StatefulSet")
MOLT = ("rollout", "gateway", "envs", "trainer")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: tools.render(*values) for name, values in VALUE_SETS.items()}


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs):
    return {n: w for kind in WORKLOADS for n, w in by_kind(docs, kind).items()}


def pod_spec(docs, name):
    return workloads(docs)[name]["spec"]["template"]["spec"]


def main_container(docs, name):
    return pod_spec(docs, name)["containers"][0]


def env_of(c):
    return {e["name"]: e for e in c.get("env", [])}


def test_trainer_saves_on_schedule_and_at_the_end_to_a_pvc_and_resumes(rendered):
    for name, docs in rendered.items():
        args = main_container(docs, "molt-trainer")["args"]
        flags = dict(a[2:].split("=", 1) if "=" in a else (a[2:], True) for a in args if a.startswith("--ckpt."))
        assert int(flags["ckpt.save_steps"]) > 0, name  # -1 would never save
        assert flags["ckpt.load_enable"] is True and flags["ckpt.save_hf"] is True, name
        assert flags["ckpt.output_dir"] == flags["ckpt.path"] + "/final-hf", name  # the final HF policy
        spec = pod_spec(docs, "molt-trainer")
        vol = next(v for v in spec["volumes"] if v["name"] == "checkpoints")
        assert "emptyDir" not in vol and "persistentVolumeClaim" in vol, name
        mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "checkpoints")
        assert mount["mountPath"] == flags["ckpt.path"] and not mount.get("readOnly")
        claim = vol["persistentVolumeClaim"]["claimName"]
        if name == "multinode-trainer":
            assert claim == "molt-checkpoints-rwx"  # the user's claim
            assert "molt-checkpoints" not in by_kind(docs, "PersistentVolumeClaim")
        else:
            pvc = by_kind(docs, "PersistentVolumeClaim")[claim]
            assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every trainer node and rollout pod
            assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # survives uninstall


def _run_pick(script: str, flags: list[str], ckpt: Path) -> list[str]:
    """Run a rollout container's start script against checkpoint layout ``ckpt`` with the service replaced by
    ``echo``: the argv it would exec, with /checkpoints paths as the container sees them."""
    assert script.count("exec python -m services.rollout ") == 1
    local = script.replace("/checkpoints", str(ckpt)).replace("exec python -m services.rollout ", "echo ")
    out = subprocess.run(
        ["sh", "-c", local, "rollout", *flags], check=True, capture_output=True, text=True, timeout=30
    )
    return out.stdout.strip().splitlines()[-1].replace(str(ckpt), "/checkpoints").split(" ")


def test_rollout_pods_start_from_the_newest_hf_export(rendered, tmp_path):
    """The pick runs in the main container at every start (an OOM or liveness restart too), never once per
    pod: the trainer prunes old exports, so a choice made when the pod was created can vanish."""
    docs = rendered["default"]
    spec = pod_spec(docs, "molt-rollout")
    c = spec["containers"][0]
    assert "initContainers" not in spec
    assert c["command"] == ["sh", "-c"] and c["args"][1] == "rollout"  # $0, then the flags as "$@"
    script, flags = c["args"][0], c["args"][2:]
    assert "--server.port=8000" in flags and not any(a.startswith("--model.path") for a in flags)
    assert not any("/run/molt" in str(x) for x in (c["volumeMounts"], spec["volumes"], script))
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["checkpoints"]["readOnly"] is True
    ckpt = next(v for v in spec["volumes"] if v["name"] == "checkpoints")["persistentVolumeClaim"]
    assert ckpt == {"claimName": "molt-checkpoints", "readOnly": True}

    def pick(layout: dict[str, bool]) -> str:
        root = tmp_path / f"case{len(list(tmp_path.iterdir()))}" / "ckpt"
        for i, (rel, complete) in enumerate(layout.items()):
            d = root / rel
            d.mkdir(parents=True)
            if complete:
                (d / "config.json").write_text("{}")
            t = 1_700_000_000 + i * 100  # later entries are newer
            os.utime(d, (t, t))
        root.mkdir(parents=True, exist_ok=True)
        argv = _run_pick(script, flags, root)
        assert argv[1:] == flags  # the chart's flags reach the service unchanged
        return argv[0].removeprefix("--model.path=")

    assert pick({}) == "/models/model"  # nothing exported yet: the base model
    assert pick({"_hf/global_step50": True, "_hf/global_step100": True}) == "/checkpoints/_hf/global_step100"
    assert pick({"_hf/global_step50": True, "_hf/global_step100": False}) == "/checkpoints/_hf/global_step50"
    assert pick({"_hf/global_step50": True, "final-hf": True}) == "/checkpoints/final-hf"
    # a restart after the trainer pruned the export the pod first started from picks again
    root = tmp_path / "restart" / "ckpt"
    for step in (50, 100):
        (root / f"_hf/global_step{step}").mkdir(parents=True)
        (root / f"_hf/global_step{step}/config.json").write_text("{}")
        os.utime(root / f"_hf/global_step{step}", (1_700_000_000 + step, 1_700_000_000 + step))
    assert _run_pick(script, flags, root)[0] == "--model.path=/checkpoints/_hf/global_step100"
    shutil.rmtree(root / "_hf/global_step50")
    (root / "_hf/global_step150").mkdir()
    (root / "_hf/global_step150/config.json").write_text("{}")
    assert _run_pick(script, flags, root)[0] == "--model.path=/checkpoints/_hf/global_step150"
    off = tools.render(sets=("rollout.startFromCheckpoint=false",))
    assert main_container(off, "molt-rollout")["command"] == ["python", "-m", "services.rollout"]
    assert "--model.path=/models/model" in main_container(off, "molt-rollout")["args"]
    out = tools.helm(
        "template", "molt", str(tools.CHART), "--set", "trainer.checkpoints.accessModes={ReadWriteOnce}", check=False
    )
    assert out.returncode != 0 and "ReadWriteMany" in out.stderr


def test_weight_token_reaches_pods_and_trainer_from_one_secret(rendered):
    for docs in rendered.values():
        refs = {
            w: env_of(main_container(docs, w))["MOLT_WEIGHTS_TOKEN"]["valueFrom"]["secretKeyRef"]
            for w in ("molt-rollout", "molt-trainer")
        }
        assert refs["molt-rollout"] == refs["molt-trainer"] == {"name": "molt-weights", "key": "MOLT_WEIGHTS_TOKEN"}
        token = by_kind(docs, "Secret")["molt-weights"]["stringData"]["MOLT_WEIGHTS_TOKEN"]
        assert len(token) >= 32 and token.isalnum()
        for w in ("molt-gateway", "molt-envs"):
            assert "MOLT_WEIGHTS_TOKEN" not in env_of(main_container(docs, w))
    ext = tools.render(sets=("weightSync.existingSecret=my-token",))
    assert "molt-weights" not in by_kind(ext, "Secret")
    assert (
        env_of(main_container(ext, "molt-trainer"))["MOLT_WEIGHTS_TOKEN"]["valueFrom"]["secretKeyRef"]["name"]
        == "my-token"
    )


def test_redis_requires_a_password_and_keeps_an_append_only_file(rendered):
    docs = rendered["default"]
    c = main_container(docs, "molt-redis")
    args = c["args"]
    assert 'requirepass "$pass"' in args[0] and "--requirepass" not in args  # stdin, not argv
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--appendfsync") + 1] == "everysec"
    env = env_of(c)
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "molt-redis", "key": "password"}
    assert env["REDISCLI_AUTH"]["value"] == "$(REDIS_PASSWORD)"  # the redis-cli readiness probe authenticates
    assert len(by_kind(docs, "Secret")["molt-redis"]["stringData"]["password"]) >= 32
    assert "volumeClaimTemplates" in workloads(docs)["molt-redis"]["spec"]  # the AOF is on a PVC


def test_pods_run_non_root_read_only_without_capabilities_or_api_tokens(rendered):
    for name, docs in rendered.items():
        sa = by_kind(docs, "ServiceAccount")["molt"]
        assert sa["automountServiceAccountToken"] is False
        for wname, w in workloads(docs).items():
            spec = w["spec"]["template"]["spec"]
            assert spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == "molt", wname
            psc = spec["securityContext"]
            assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0, wname
            # env workers whose tools run untrusted code may need namespaces (bubblewrap): their own profile
            want = "Unconfined" if (name, wname) == ("multinode-trainer", "molt-envs") else "RuntimeDefault"
            assert psc["seccompProfile"] == {"type": want}, (name, wname)
            for c in spec["containers"] + spec.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True, (wname, c["name"])
                assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
            c = spec["containers"][0]
            writable = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
            if wname != "molt-redis":  # caches and scratch: HOME is under the writable /tmp
                assert "/tmp" in writable and env_of(c)["HOME"]["value"].startswith("/tmp/"), wname
            else:
                assert writable == {"/data"}


def test_disruption_budgets_cover_gateway_envs_and_rollout(rendered):
    for name, docs in rendered.items():
        pdbs = by_kind(docs, "PodDisruptionBudget")
        assert set(pdbs) == {"molt-gateway", "molt-envs", "molt-rollout"}, name
        for pname, pdb in pdbs.items():
            assert pdb["spec"]["maxUnavailable"] == 1  # a drain evicts one at a time and never blocks
            labels = workloads(docs)[pname]["spec"]["template"]["metadata"]["labels"]
            assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


class _Stub(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/healthz" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_trainer_probes_check_rank_zero_and_pass_on_other_nodes():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        docs = tools.render(sets=(f"trainer.metricsPort={port}",))
        c = main_container(docs, "molt-trainer")

        def probe(kind: str, node_rank: str) -> int:
            cmd = c[kind]["exec"]["command"]
            return subprocess.run(
                [sys.executable, *cmd[1:]], env={"NODE_RANK": node_rank}, capture_output=True, timeout=30, check=False
            ).returncode

        assert probe("livenessProbe", "0") == 0 and probe("startupProbe", "0") == 0
        assert probe("readinessProbe", "0") != 0  # /readyz answers 503 here: not ready
        assert probe("readinessProbe", "1") == 0 and probe("livenessProbe", "3") == 0  # no server on node 1+
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 3600
    finally:
        server.shutdown()


def _allowed(docs, src: str, dst: str, port: int | str, egress_port: int) -> bool:
    """Does a pod of component ``src`` reach component ``dst`` on ``port`` (a container port name or
    number) under the rendered NetworkPolicies? Same namespace: peers by namespace or IP block never match."""
    labels = {
        w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: w["spec"]["template"]["metadata"][
            "labels"
        ]
        for w in workloads(docs).values()
    }
    policies = list(by_kind(docs, "NetworkPolicy").values())

    def selects(sel, comp):
        return sel.get("matchLabels", {}).items() <= labels[comp].items()

    def peer_ok(peers, comp):
        return peers is None or any(p.keys() == {"podSelector"} and selects(p["podSelector"], comp) for p in peers)

    def port_ok(ports, want):
        return ports is None or any(p["port"] == want for p in ports)

    ingress = [p for p in policies if "Ingress" in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], dst)]
    egress = [p for p in policies if "Egress" in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], src)]
    ok_in = not ingress or any(
        peer_ok(r.get("from"), src) and port_ok(r.get("ports"), port)
        for p in ingress
        for r in p["spec"].get("ingress", [])
    )
    ok_out = not egress or any(
        peer_ok(r.get("to"), dst) and port_ok(r.get("ports"), egress_port)
        for p in egress
        for r in p["spec"].get("egress", [])
    )
    return ok_in and ok_out


def test_network_policies_let_only_the_trainer_change_weights_and_data_writers_reach_redis(rendered):
    docs = rendered["default"]

    def reach(src, dst, port, num):
        return _allowed(docs, src, dst, port, num)

    for src in ("gateway", "envs", "redis"):
        assert not reach(src, "rollout", "grpc", 50051), src  # weight sync: the trainer only
    assert reach("trainer", "rollout", "grpc", 50051) and reach("trainer", "rollout", "http", 8000)
    assert reach("gateway", "rollout", "http", 8000)
    assert not reach("envs", "rollout", "http", 8000)
    for src in ("gateway", "trainer"):
        assert reach(src, "redis", "redis", 6379), src
    assert not reach("rollout", "redis", "redis", 6379)
    # env workers (and the untrusted tool code they run) reach the gateway only: never the trajectory store,
    # which they do not use (no redis setting, no MOLT_REDIS__URL)
    assert reach("envs", "gateway", "http", 8080)
    for dst, port, num in (
        ("rollout", "http", 8000),
        ("trainer", "metrics", 9400),
        ("trainer", "torchrun", 29500),
        ("redis", "redis", 6379),
    ):
        assert not reach("envs", dst, port, num), dst
    envs_env = {e["name"] for e in main_container(docs, "molt-envs")["env"]}
    assert not any("REDIS" in name for name in envs_env), envs_env
    envs_policy = by_kind(docs, "NetworkPolicy")["molt-envs"]["spec"]
    assert "Egress" in envs_policy["policyTypes"]
    assert all("to" in r for r in envs_policy["egress"])  # no rule opens egress to everything
    assert reach("trainer", "trainer", "torchrun", 29500) and not reach("gateway", "trainer", "torchrun", 29500)
    assert reach("trainer", "envs", "http", 8090)
    assert not by_kind(tools.render(sets=("networkPolicy.enabled=false",)), "NetworkPolicy")


def test_narrowing_the_gateways_callers_keeps_the_releases_own_and_prometheus():
    outside = {"ipBlock": {"cidr": "10.1.0.0/16"}}
    docs = tools.render(sets=("networkPolicy.gatewayFrom[0].ipBlock.cidr=10.1.0.0/16",))
    [rule] = by_kind(docs, "NetworkPolicy")["molt-gateway"]["spec"]["ingress"]
    prometheus = yaml.safe_load((tools.CHART / "values.yaml").read_text())["networkPolicy"]["metricsFrom"]
    assert outside in rule["from"] and all(p in rule["from"] for p in prometheus)
    for src in ("envs", "gateway"):  # env workers open sessions; replicas forward each other's
        assert _allowed(docs, src, "gateway", "http", 8080), src
    assert not _allowed(docs, "rollout", "gateway", "http", 8080)
    [open_rule] = by_kind(tools.render(), "NetworkPolicy")["molt-gateway"]["spec"]["ingress"]
    assert "from" not in open_rule  # not narrowed: anyone who reaches the Service (keys still apply)


def test_ci_values_name_files_that_exist():
    for values in sorted((tools.CHART / "ci").glob("*.yaml")):
        agents = (yaml.safe_load(values.read_text()).get("envs") or {}).get("agents") or {}
        for name, path in agents.items():
            assert (ROOT / path).is_file(), f"{values.name}: envs.agents.{name} = {path} does not exist"


def _notes(*sets: str) -> str:
    args = ["install", "molt", str(tools.CHART), "-n", "rl", "--dry-run=client"]
    for s in sets:
        args += ["--set", s]
    out = tools.helm(*args).stdout
    return out[out.index("NOTES:") :]


def _route_literals(package: str) -> set[str]:
    text = "".join(p.read_text() for p in sorted((ROOT / "services" / package).glob("*.py")))
    return set(re.findall(r"""["'](/[A-Za-z0-9_/{}.:-]*)["']""", text))


@pytest.mark.parametrize("sets", [(), ("gateway.apiKeys.keys={sk-molt-0123456789abcdef,sk-molt-fedcba9876543210}",)])
def test_notes_commands_name_real_keys_ports_and_routes(sets):
    notes = _notes(*sets)
    docs = tools.render(sets=sets)
    secrets = by_kind(docs, "Secret")
    services = by_kind(docs, "Service")
    gets = re.findall(r"get secret (\S+) -o jsonpath='\{\.data\.([A-Za-z0-9_]+)\}'", notes)
    assert gets
    for name, key in gets:
        assert key in secrets[name]["stringData"], f"NOTES reads {name}.{key}"
    forwards = {}
    for kind, name, port in re.findall(r"port-forward (svc|pod)/(\S+) (\d+)", notes):
        if kind == "svc":
            assert int(port) in [p["port"] for p in services[name]["spec"]["ports"]], name
            component = services[name]["spec"]["selector"]["app.kubernetes.io/component"]
        else:
            sts, _, ordinal = name.rpartition("-")
            c = main_container(docs, sts)
            assert int(ordinal) < workloads(docs)[sts]["spec"]["replicas"]
            assert int(port) in [p["containerPort"] for p in c["ports"]], name
            component = sts.removeprefix("molt-")
        forwards[int(port)] = component
    routes = {"gateway": _route_literals("gateway"), "trainer": _route_literals("trainer")}
    urls = re.findall(r"http://127\.0\.0\.1:(\d+)(/\S*)", notes)
    assert urls
    for port, path in urls:
        component = forwards[int(port)]  # only ports the commands above forward
        route = path.rstrip("'\"").replace("<id>", "{sid}")
        assert route in routes[component], f"NOTES points at {path} on the {component}: no such route"
    assert not re.search(r"OPENAI_BASE_URL=\S*/v1\b", notes)  # the session-less /v1 captures nothing


def test_optional_mutual_tls_on_the_weight_port(tmp_path):
    import kubernetes_validate

    docs = tools.render(sets=("weightSync.tlsSecret=molt-weights-tls",))
    for name in ("molt-rollout", "molt-trainer"):
        kubernetes_validate.validate(workloads(docs)[name], "1.28.0", strict=True)
    pod, trainer = pod_spec(docs, "molt-rollout"), pod_spec(docs, "molt-trainer")
    for spec in (pod, trainer):
        vol = next(v for v in spec["volumes"] if v["name"] == "weights-tls")
        assert vol["secret"] == {"secretName": "molt-weights-tls"}
        mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "weights-tls")
        assert mount["readOnly"] is True and mount["mountPath"] == "/etc/molt/weights-tls"
    args = pod["containers"][0]["args"]
    tls = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if a.startswith("--grpc.tls")}
    assert tls == {
        "--grpc.tls_cert": "/etc/molt/weights-tls/tls.crt",
        "--grpc.tls_key": "/etc/molt/weights-tls/tls.key",
        "--grpc.tls_client_ca": "/etc/molt/weights-tls/ca.crt",
    }  # client certificates required
    service, argv = tools.service_argv(pod["containers"][0]["command"] + args)
    settings = tools.parse_service(service, argv, {})
    assert settings.grpc.tls_client_ca == "/etc/molt/weights-tls/ca.crt"
    env = {e["name"]: e.get("value") for e in trainer["containers"][0]["env"]}
    assert env["MOLT_WEIGHTS_TLS_CA"] == "/etc/molt/weights-tls/ca.crt"
    assert env["MOLT_WEIGHTS_TLS_CERT"] == "/etc/molt/weights-tls/tls.crt"
    assert env["MOLT_WEIGHTS_TLS_KEY"] == "/etc/molt/weights-tls/tls.key"
    plain = tools.render()
    assert not any(a.startswith("--grpc.tls") for a in main_container(plain, "molt-rollout")["args"])

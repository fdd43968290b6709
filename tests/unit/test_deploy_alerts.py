"""promtool unit tests of every shipped alert: each fires on the fault it names, and none fires on healthy
async training (trainer consuming, pods two versions behind, staleness-inclusive mismatch KL at 0.178 while the
fresh-token KL is 1.8e-3, a trickle of 5xx).

The rules come from the rendered chart (namespace rl, every rule on). promtool (scripts/promtool.sh: PATH, or
Debian's prometheus package unpacked into .cache/tools) runs the tests; annotations are dropped from the copy
it unit-tests (their text holds humanized values) and checked as templates by `promtool check rules` instead.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy import tools

ROOT = Path(__file__).resolve().parents[2]
NS = 'namespace="rl"'
POD_URL = "http://molt-rollout-0.molt-rollout.rl.svc.cluster.local:8000"
STREAM = "molt:trajectories"
STEPS = 120  # minutes of series, one sample a minute


def s(name: str, labels: str = "") -> str:
    return f"{name}{{{NS}{',' + labels if labels else ''}}}"


def buckets(name: str, labels: str, counts: dict[str, str]) -> dict[str, str]:
    return {s(name, f'{labels},le="{le}"'): values for le, values in counts.items()}


FLAT0 = f"0+0x{STEPS}"
# Healthy async training: everything flows, pods trail the trainer by 2 versions, stale tokens make the
# staleness-inclusive KL large (0.178) while the fresh-token KL stays at 1.8e-3, 0.1% of requests fail.
HEALTHY: dict[str, str] = {
    s("molt_queue_undelivered_entries", f'stream="{STREAM}"'): f"150+0x{STEPS}",
    s("molt_queue_oldest_unacked_age_seconds", f'stream="{STREAM}"'): f"30+0x{STEPS}",
    s("molt_queue_dead_letter_total", f'stream="{STREAM}"'): FLAT0,
    s("molt_trainer_mismatch_kl_fresh"): f"0.0018+0x{STEPS}",
    s("molt_trainer_mismatch_kl", f'rollout_url="{POD_URL}"'): f"0.178+0x{STEPS}",
    s("molt_trainer_trajectories_total", 'outcome="trained"'): f"0+64x{STEPS}",
    s("molt_trainer_step"): f"0+1x{STEPS}",
    s("molt_envs_episodes_total", 'agent="math",status="ok"'): f"0+64x{STEPS}",
    s("molt_gateway_trajectories_written_total"): f"0+64x{STEPS}",
    s("molt_envs_rejected_total"): FLAT0,
    s("molt_envs_event_loop_stalls_total", 'agent="math"'): FLAT0,
    s("molt_gateway_requests_total", 'wire="openai",code="200"'): f"0+500x{STEPS}",
    s("molt_gateway_requests_total", 'wire="openai",code="500"'): f"0+0.5x{STEPS}",
    s("molt_weightsync_failures_total", 'side="trainer",reason="unavailable"'): FLAT0,
    s("molt_weightsync_check_failures_total", f'rollout_url="{POD_URL}"'): FLAT0,
    **buckets(
        "molt_weightsync_phase_seconds_bucket",
        'side="trainer",phase="transfer"',
        {
            "1": f"0+1x{STEPS}",
            "10": f"0+1x{STEPS}",
            "120": f"0+1x{STEPS}",
            "300": f"0+1x{STEPS}",
            "+Inf": f"0+1x{STEPS}",
        },
    ),
    **buckets(
        "molt_rollout_weight_apply_seconds_bucket",
        'pod="molt-rollout-0"',
        {"0.5": f"0+1x{STEPS}", "60": f"0+1x{STEPS}", "120": f"0+1x{STEPS}", "+Inf": f"0+1x{STEPS}"},
    ),
    s("molt_trainer_policy_version"): f"0+1x{STEPS}",
    s("molt_rollout_policy_version", 'pod="molt-rollout-0"'): f"0 0 0+1x{STEPS - 2}",
    s("molt_gateway_pod_healthy", f'rollout_url="{POD_URL}"'): f"1+0x{STEPS}",
    **{
        s("up", f'job="molt-{c}",pod="molt-{c}-0",instance="10.0.0.{i}:80"'): f"1+0x{STEPS}"
        for i, c in enumerate(("rollout", "gateway", "envs", "trainer"))
    },
    s("kube_pod_status_ready", 'condition="true",pod="molt-rollout-0"'): f"1+0x{STEPS}",
}

# alert -> (series replaced or added, eval minute, labels of the firing alert besides severity)
FAULTS: dict[str, tuple[dict[str, str], int, dict[str, str]]] = {
    "MoltQueueBacklogGrowing": (
        {s("molt_queue_undelivered_entries", f'stream="{STREAM}"'): f"6000+100x{STEPS}"},
        60,
        {"stream": STREAM},
    ),
    "MoltQueueOldestUnackedOld": (
        {s("molt_queue_oldest_unacked_age_seconds", f'stream="{STREAM}"'): f"0+60x{STEPS}"},
        30,
        {"stream": STREAM},
    ),
    "MoltQueueDeadLetters": (
        {s("molt_queue_dead_letter_total", f'stream="{STREAM}"'): f"0+0x5 1+0x{STEPS - 6}"},
        10,
        {"stream": STREAM},
    ),
    "MoltMismatchKLFreshHigh": ({s("molt_trainer_mismatch_kl_fresh"): f"0.05+0x{STEPS}"}, 30, {}),
    "MoltNoTrajectoriesArriving": (
        {s("molt_trainer_trajectories_total", 'outcome="trained"'): f"1000+0x{STEPS}"},
        60,
        {},
    ),
    "MoltGatewayWritesNoTrajectories": ({s("molt_gateway_trajectories_written_total"): f"500+0x{STEPS}"}, 60, {}),
    "MoltEnvWorkersSaturated": ({s("molt_envs_rejected_total"): f"0+5x{STEPS}"}, 60, {}),
    "MoltEnvWorkerEventLoopStalled": (
        {s("molt_envs_event_loop_stalls_total", 'agent="math"'): f"0+1x{STEPS}"},
        30,
        {"agent": "math"},
    ),
    "MoltGatewayErrorRateHigh": (
        {s("molt_gateway_requests_total", 'wire="openai",code="500"'): f"0+100x{STEPS}"},
        60,
        {},
    ),
    "MoltWeightSyncFailing": (
        {s("molt_weightsync_failures_total", 'side="trainer",reason="unavailable"'): f"0+0x5 1+0x{STEPS - 6}"},
        10,
        {"side": "trainer", "reason": "unavailable"},
    ),
    "MoltWeightCheckRefused": (
        {s("molt_weightsync_check_failures_total", f'rollout_url="{POD_URL}"'): f"0+0x5 1+0x{STEPS - 6}"},
        10,
        {"rollout_url": POD_URL},
    ),
    "MoltWeightSyncSlow": (
        buckets(
            "molt_weightsync_phase_seconds_bucket",
            'side="trainer",phase="transfer"',
            {"1": FLAT0, "10": FLAT0, "120": FLAT0, "300": f"0+1x{STEPS}", "+Inf": f"0+1x{STEPS}"},
        ),
        60,
        {"side": "trainer", "phase": "transfer"},
    ),
    "MoltWeightApplySlow": (
        buckets(
            "molt_rollout_weight_apply_seconds_bucket",
            'pod="molt-rollout-0"',
            {"0.5": FLAT0, "60": FLAT0, "120": f"0+1x{STEPS}", "+Inf": f"0+1x{STEPS}"},
        ),
        60,
        {"pod": "molt-rollout-0"},
    ),
    "MoltRolloutPolicyBehind": (
        {s("molt_rollout_policy_version", 'pod="molt-rollout-0"'): f"0+0x{STEPS}"},
        30,
        {"pod": "molt-rollout-0"},
    ),
    "MoltRolloutPodUnhealthy": (
        {s("molt_gateway_pod_healthy", f'rollout_url="{POD_URL}"'): f"0+0x{STEPS}"},
        30,
        {"rollout_url": POD_URL},
    ),
    "MoltTargetDown": (
        {s("up", 'job="molt-gateway",pod="molt-gateway-0",instance="10.0.0.1:80"'): f"0+0x{STEPS}"},
        30,
        {"job": "molt-gateway", "pod": "molt-gateway-0", "instance": "10.0.0.1:80", "namespace": "rl"},
    ),
    "MoltPodsNotReady": (
        {s("kube_pod_status_ready", 'condition="true",pod="molt-rollout-0"'): f"0+0x{STEPS}"},
        30,
        {"pod": "molt-rollout-0"},
    ),
}


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "promtool.sh"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def rules(tmp_path_factory) -> tuple[Path, Path, dict[str, dict]]:
    """(rules file, the same without annotations, alert name -> rule) from the rendered chart."""
    docs = tools.render("ci/multinode-trainer-values.yaml")
    groups = next(d for d in docs if d["kind"] == "PrometheusRule")["spec"]["groups"]
    out = tmp_path_factory.mktemp("alerts")
    full, bare = out / "rules.yml", out / "rules-bare.yml"
    full.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    stripped = copy.deepcopy(groups)
    for g in stripped:
        for r in g["rules"]:
            r.pop("annotations", None)
    bare.write_text(yaml.safe_dump({"groups": stripped}, sort_keys=False))
    alerts = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    return full, bare, alerts


def _series(overrides: dict[str, str]) -> list[dict]:
    return [{"series": k, "values": v} for k, v in {**HEALTHY, **overrides}.items()]


def test_rules_and_annotation_templates_are_valid(rules):
    full, _, _ = rules
    out = _promtool("check", "rules", str(full))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_fault_test(rules):
    assert set(FAULTS) == set(rules[2])


def test_each_alert_fires_on_its_fault_and_none_on_healthy_async_training(rules, tmp_path):
    _, bare, alerts = rules
    quiet = [{"eval_time": f"{m}m", "alertname": name, "exp_alerts": []} for name in alerts for m in (30, 60, 120)]
    tests = [
        {"name": "healthy async training", "interval": "1m", "input_series": _series({}), "alert_rule_test": quiet}
    ]
    for name, (overrides, minute, labels) in FAULTS.items():
        severity = alerts[name]["labels"]["severity"]
        tests.append(
            {
                "name": f"{name} fires on its fault",
                "interval": "1m",
                "input_series": _series(overrides),
                "alert_rule_test": [
                    {"eval_time": "1m", "alertname": name, "exp_alerts": []},  # nothing at the start (`for` holds)
                    {
                        "eval_time": f"{minute}m",
                        "alertname": name,
                        "exp_alerts": [{"exp_labels": {**labels, "severity": severity}}],
                    },
                ],
            }
        )
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(
        yaml.safe_dump({"rule_files": [str(bare)], "evaluation_interval": "1m", "tests": tests}, sort_keys=False)
    )
    out = _promtool("test", "rules", str(spec))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]

"""`molt train-rl --envs.episode_timeout_s N` (not Molt's: Molt has no episode limit) reaches the env workers, on
the local stack and in the emitted Helm values; the trainer gets no flag of its own, as it follows the workers."""

from __future__ import annotations

import json

import pytest

from molt.stack import train_rl as tr
from molt.stack import train_rl_helm as trh

AGENT = ["--actor.model_name_or_path", "/m", "--train.agent_path", "/a/x.py"]


def test_the_flag_goes_to_the_env_workers_only():
    r = tr.route([*AGENT, "--envs.episode_timeout_s", "3600", "--rollout.num_runners", "2"])
    assert r.envs == ["--envs.episode_timeout_s", "3600"] and r.num_envs == 2
    assert "--envs.episode_timeout_s" not in r.trainer + r.rollout + r.gateway
    assert not any(a.startswith("--envs.timeout_s") for a in r.trainer)
    assert tr.route(AGENT).envs == []


@pytest.mark.parametrize("values", [["0"], ["-5"], ["soon"], ["inf"], [], ["1", "2"]])
def test_a_bad_value_is_one_line_naming_the_flag(values):
    with pytest.raises(ValueError, match=r"^--envs.episode_timeout_s takes one number of seconds > 0 \(e.g. 3600\)"):
        tr.route([*AGENT, "--envs.episode_timeout_s", *values])


def test_a_misspelling_gets_a_did_you_mean():
    with pytest.raises(ValueError, match="did you mean --envs.episode_timeout_s"):
        tr.route([*AGENT, "--envs.episode_timeout"])


def test_helm_values_set_the_charts_episode_limit_in_whole_seconds():
    values = trh.helm_values(tr.route([*AGENT, "--envs.episode_timeout_s", "3600"], "helm"), environ={})
    assert values["envs"]["episodeTimeoutSeconds"] == 3600
    assert not any("timeout" in a for a in values["trainer"]["extraArgs"])
    rounded = trh.helm_values(tr.route([*AGENT, "--envs.episode_timeout_s=90.2"], "helm"), environ={})
    assert rounded["envs"]["episodeTimeoutSeconds"] == 91  # never shorter than asked
    assert "episodeTimeoutSeconds" not in trh.helm_values(tr.route(AGENT, "helm"), environ={})["envs"]


def test_emitted_values_render_the_limit_on_the_workers_and_nothing_on_the_trainer(tmp_path):
    from deploy import tools
    from tests.unit.test_deploy_helm import by_kind, container, flag

    path, mount = tmp_path / "values.yaml", tmp_path / "mount.yaml"
    argv = ["--actor.model_name_or_path", "/home/me/m", "--train.agent_path", "x.py", "--envs.episode_timeout_s=3600"]
    trh.write_helm_values(tr.route(argv, "helm"), path, environ={})
    home = {"name": "home", "hostPath": {"path": "/srv/me", "type": "Directory"}}
    volumes = {"extraVolumes": [home], "extraVolumeMounts": [{"name": "home", "mountPath": "/home/me"}]}
    mount.write_text(json.dumps(volumes))  # the model's path, as the cluster would mount it
    docs = tools.render(str(path), str(mount))
    assert float(flag(container(docs, "molt-envs"), "--envs.episode_timeout_s")) == 3600
    spec = by_kind(docs, "Deployment")["molt-envs"]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > 3600
    trainer = container(docs, "molt-trainer")
    assert not [a for a in trainer.get("command", []) + trainer.get("args", []) if "envs.timeout_s" in a]


def _model_and_agent(tmp_path) -> list[str]:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "agent.py").write_text("")
    (tmp_path / "p.jsonl").write_text('{"input": "q"}\n')
    return [
        *("--actor.model_name_or_path", str(tmp_path / "model"), "--train.agent_path", str(tmp_path / "agent.py")),
        *("--data.prompt_dataset", str(tmp_path / "p.jsonl")),
    ]


def test_the_local_stack_starts_every_env_worker_with_it_and_the_dry_run_shows_it(tmp_path, capsys):
    from molt import cli
    from molt.stack.services import Services

    argv = [*_model_and_agent(tmp_path), "--envs.episode_timeout_s", "3600", "--rollout.num_runners", "2"]
    plan = tr.local_plan(tr.route(argv), tmp_path / "run", None, False)
    assert plan.envs == ["--envs.episode_timeout_s", "3600"] and plan.num_envs == 2
    svc = Services(plan, tmp_path / "run", None, {}, {}, [], tmp_path / "steps.jsonl")
    svc.gateway_url = "http://127.0.0.1:1"
    for i in range(2):
        cmd = svc.envs(i)(8090 + i).cmd
        assert cmd[cmd.index("--envs.episode_timeout_s") + 1] == "3600"
    svc.envs_urls = ["http://127.0.0.1:8090"]
    trainer = " ".join(svc.trainer(9000).cmd)
    assert "--envs.timeout_s" not in trainer and "--envs.episode_timeout_s" not in trainer
    assert cli.train_rl(["--dry-run", *argv]) == 0  # the env workers' own parse takes it
    assert json.loads(capsys.readouterr().out)["envs"] == ["--envs.episode_timeout_s", "3600"]
    assert cli.train_rl(["--dry-run", *argv[:-2], "--envs.episode_timeout_s", "never"]) == 2
    assert "--envs.episode_timeout_s takes one number of seconds" in capsys.readouterr().err

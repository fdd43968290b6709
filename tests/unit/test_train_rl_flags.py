"""`molt train-rl`: Molt's launch-script flags routed to the services (pure routing; no processes).

The scripts are Molt's own (tests/fixtures/molt_examples/scripts, vendored unchanged)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from molt.stack import train_rl as tr
from molt.stack import train_rl_helm as trh

SCRIPTS = Path(__file__).resolve().parents[1] / "fixtures" / "molt_examples" / "scripts"
FLAG = re.compile(r"--[a-z_]+(?:\.[a-z_0-9]+)+")


def quick_start_argv(name: str, **env: str) -> list[str]:
    """The train_rl_ray command of a quick_start script, its shell variables set to the script's defaults."""
    text = (SCRIPTS / name).read_text()
    block = text.split("-m molt.cli.train_rl_ray \\\n", 1)[1].split("\n\n", 1)[0]
    defaults = dict(re.findall(r'^(\w+)="\$\{\w+:-([^}]*)\}"', text, re.M))
    env = {**defaults, "MODEL_PATH": "/models/qwen3-4b", "REPO_ROOT": "/molt", **env}

    def sub(m: re.Match) -> str:
        return env.get(m.group(1), m.group(3) or "x")

    for _ in range(2):  # defaults may name other variables
        block = re.sub(r"\$\{?(\w+)(:-([^}]*))?\}?", sub, block)
    block = block.replace("$$", "1")
    return shlex.split(block.replace("\\\n", " "))


def test_every_flag_name_of_molts_rl_scripts_is_known():
    every = tr.trainer_flag_names() | tr.POD_FLAGS | set(tr.PLACEMENT) | set(tr.MISSING) | tr.WIRING
    every |= {"actor.num_nodes", "actor.num_gpus_per_node"}
    names = {f[2:] for p in SCRIPTS.glob("*.sh") for f in FLAG.findall(p.read_text())}
    assert len(names) >= 90
    assert sorted(names - every) == []


def test_quick_start_flags_route_to_helm_values_unchanged():
    from molt.config import parse_settings
    from services.rollout.config import RolloutSettings
    from services.trainer.config import TrainerSettings

    r = tr.route(quick_start_argv("quick_start_rl_qwen3_4b.sh"), "helm")
    # each service's own parser takes what it was routed
    parse_settings(TrainerSettings, r.trainer + ["--train.dispatch", "false"], prog="trainer")
    parse_settings(RolloutSettings, r.rollout, prog="rollout")
    values = trh.helm_values(r)
    assert r.model == "/models/qwen3-4b" and r.agent_path.endswith("examples/python/agents/math.py")
    assert values["rollout"]["gpusPerPod"] == 4 and values["trainer"]["gpusPerNode"] == 4
    assert values["trainer"]["checkpoints"] == {"saveSteps": 5}
    assert "--algo.advantage.is_correction_level" in r.trainer and "--fsdp.packing_samples" in r.trainer
    assert "--vllm.max_model_len 16384" in " ".join(r.rollout)
    assert values["gateway"]["extraArgs"] == ["--session.max_length", "16384"]
    assert (
        "--vllm.sync_backend: weights travel to the pods over gRPC (molt.weightsync), whatever the backend" in r.notes
    )


def test_on_this_cpu_machine_gpu_flags_are_refused_with_the_reason():
    with pytest.raises(ValueError) as err:
        tr.route(quick_start_argv("quick_start_rl_qwen3_4b.sh"), "local", gpus=0)
    msg = str(err.value)
    assert "--vllm.tensor_parallel_size 4: tensor-parallel rollout needs 4 GPUs per pod; this machine has 0" in msg
    assert "--vllm.sync_backend nccl: NCCL needs GPUs" in msg
    assert "--fsdp.attn_implementation flash_attention_2: flash_attention_2 kernels need a GPU" in msg
    assert "--actor.num_gpus_per_node 4: asks for 4 GPUs per node" in msg
    assert "unknown" not in msg  # every other flag is accepted


def test_unknown_flags_get_a_did_you_mean_and_missing_features_their_reason():
    with pytest.raises(ValueError) as err:
        tr.route(
            [
                "--actor.model_name_or_path",
                "/m",
                "--train.agent_path",
                "a.py",
                "--algo.advantage.estimtor",
                "grpo",
                "--vllm.pipeline_parallel_size",
                "2",
                "--vllm.data_parallel_size",
                "1",
            ],
            "helm",
        )
    msg = str(err.value)
    assert "--algo.advantage.estimtor: unknown flag; did you mean --algo.advantage.estimator?" in msg
    assert "--vllm.pipeline_parallel_size 2: pipeline-parallel rollout pods are not supported" in msg
    assert "data_parallel_size" not in msg  # 1 asks for nothing: accepted


def test_vision_language_flags_reach_the_trainer_and_the_pods():
    r = tr.route(
        [
            *("--actor.model_name_or_path", "/m", "--train.agent_path", "/a/chat_geo3k.py"),
            *("--data.image_key", "images", "--data.max_images_per_prompt", "2", "--actor.freeze_visual_encoder"),
        ]
    )
    assert r.trainer[2:] == [
        *("--data.image_key", "images", "--data.max_images_per_prompt", "2", "--actor.freeze_visual_encoder")
    ]
    assert r.rollout == ["--rollout.max_images_per_prompt", "2"]


def test_wiring_flags_set_pods_workers_and_the_agent():
    r = tr.route(
        [
            "--actor.model_name_or_path",
            "/m",
            "--train.agent_path",
            "/a/math.py",
            "--vllm.num_engines",
            "2",
            "--rollout.num_runners",
            "3",
            "--vllm.enforce_eager",
            "--data.max_len",
            "512",
        ],
        "local",
    )
    assert (r.num_pods, r.num_envs, r.agent_path) == (2, 3, "/a/math.py")
    assert r.rollout == ["--vllm.enforce_eager", "--vllm.max_model_len", "512"]
    assert r.trainer == ["--actor.model_name_or_path", "/m", "--data.max_len", "512"]


def test_routing_replay_has_the_gateway_record_the_pods_routing():
    r = tr.route(["--actor.model_name_or_path", "/m", "--train.agent_path", "/a/x.py", "--train.routing_replay"])
    assert r.trainer[-1] == "--train.routing_replay" and r.gateway == ["--rollout.return_routed_experts"]
    off = tr.route(
        ["--actor.model_name_or_path", "/m", "--train.agent_path", "/a/x.py", "--train.routing_replay", "0"]
    )
    assert off.gateway == []


def test_emitted_helm_values_render_through_the_chart(tmp_path):
    from deploy import tools

    argv = quick_start_argv("quick_start_rl_qwen3_4b.sh")
    [paths] = trh.write_helm_values(tr.route(argv, "helm"), tmp_path / "keyless.yaml", environ={})
    assert paths.startswith("model.path, trainer.promptDataset and envs.agents.agent are paths of this machine")
    # Molt hands the launching shell's W&B settings to its workers; the key is a secret and stays out of the file
    r = tr.route([*argv, "--logger.wandb.key", "flag-key-456"], "helm")
    wandb = {"WANDB_API_KEY": "secret-key-123", "WANDB_ENTITY": "ent", "WANDB_MODE": "offline", "WANDB_DIR": "/x"}
    [_, note] = trh.write_helm_values(r, tmp_path / "values.yaml", environ=wandb)
    text = (tmp_path / "values.yaml").read_text()
    assert "secret-key-123" not in text and "flag-key-456" not in text
    assert note.startswith("--logger.wandb.key and WANDB_API_KEY: not written") and "MOLT_LOGGER__WANDB__KEY" in note
    docs = tools.render(str(tmp_path / "values.yaml"))
    [trainer_env] = [
        {e["name"]: e.get("value") for e in c.get("env", [])}
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet") and "trainer" in d["metadata"]["name"]
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    assert trainer_env["WANDB_ENTITY"] == "ent" and trainer_env["WANDB_MODE"] == "offline"
    assert "WANDB_API_KEY" not in trainer_env and "WANDB_DIR" not in trainer_env
    trainer = next(
        " ".join(c.get("command", []) + c.get("args", []))
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet") and "trainer" in d["metadata"]["name"]
        for c in d["spec"]["template"]["spec"]["containers"]
    )
    assert "--logger.wandb.project" in trainer and "--logger.wandb.key" not in trainer
    args = {
        c["name"]: " ".join(c.get("command", []) + c.get("args", []))
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    trainer = next(a for name, a in args.items() if "trainer" in name)
    assert "--algo.advantage.is_correction_level geo" in trainer and "--fsdp.packing_samples" in trainer
    # storage is the chart's: the script's local --ckpt.path is not passed, the chart's volume is
    assert "/molt/outputs" not in trainer and "--ckpt.save_steps=5" in trainer
    assert any("--vllm.max_model_len 16384" in a for name, a in args.items() if "rollout" in name)


MOLT_CLI = json.loads((SCRIPTS.parents[1] / "molt_cli_flags.json").read_text())
AGENT = ["--actor.model_name_or_path", "/m", "--train.agent_path", "/a/x.py"]


def test_every_flag_molts_rl_and_sft_parsers_declare_is_known():
    from molt.config import iter_fields
    from services.trainer.sft_config import SftSettings

    every = tr.trainer_flag_names() | tr.POD_FLAGS | set(tr.PLACEMENT) | set(tr.MISSING) | tr.WIRING
    every |= {"actor.num_nodes", "actor.num_gpus_per_node"} | {"no-" + n for n in tr.NEGATABLE}
    assert len(MOLT_CLI["train_rl_ray"]) >= 150
    assert sorted(set(MOLT_CLI["train_rl_ray"]) - every) == []
    assert sorted(set(MOLT_CLI["train_sft"]) - {name for name, _, _ in iter_fields(SftSettings)}) == []


@pytest.mark.parametrize("flag", sorted(tr.NEGATABLE & tr.POD_FLAGS))
def test_molts_no_form_of_a_pod_switch_turns_it_off(flag):
    from molt.config import parse_settings
    from services.rollout.config import RolloutSettings

    r = tr.route([*AGENT, f"--no-{flag}"])
    assert r.rollout == [f"--{flag}", "false"]
    pod = parse_settings(RolloutSettings, ["--model.path", "/m", *r.rollout], prog="rollout")
    assert getattr(pod.vllm, flag.split(".")[1]) is False


def test_molts_retention_rank_and_hub_flags():
    from molt.config import parse_settings
    from services.trainer.checks import validate_settings
    from services.trainer.config import TrainerSettings

    r = tr.route([*AGENT, "--ckpt.dcp_max_num", "2", "--local_rank", "0", "--ckpt.max_num", "5"])
    s = parse_settings(TrainerSettings, [*r.trainer, "--train.dispatch", "false"], prog="t")
    validate_settings(s)
    assert (s.ckpt.resumable_max(), s.ckpt.max_num, s.local_rank) == (2, 5, 0)
    for flags, needle in ((["--use_ms"], "nothing is downloaded"), (["--ckpt.max_mem", "0"], "must be > 0")):
        s = parse_settings(TrainerSettings, [*r.trainer, "--train.dispatch", "false", *flags], prog="t")
        with pytest.raises(ValueError, match=needle):
            validate_settings(s)


def test_a_bad_trainer_flag_stops_train_rl_before_anything_starts(tmp_path, capsys):
    from molt import cli

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "agent.py").write_text("")
    argv = [
        *("--actor.model_name_or_path", str(tmp_path / "model"), "--train.agent_path", str(tmp_path / "agent.py")),
        *("--data.prompt_dataset", "/d", "--train.force_on_policy", "--train.max_epochs", "2"),
    ]
    for own in (["--dry-run"], ["--run-dir", str(tmp_path / "run")]):
        with pytest.raises(SystemExit) as stop:
            cli.train_rl([*own, *argv])
        assert stop.value.code == 2
        assert "--train.force_on_policy needs --train.max_epochs 1 (got 2)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_bad_pod_flag_stops_train_rl_before_anything_starts(tmp_path, capsys):
    """The pods' flags get their own service's parse and checks, in the dry run as in a real run: before, a bad
    --vllm.* value passed the dry run and ended a pod after Redis and the trainer had started."""
    from molt import cli

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "agent.py").write_text("")
    (tmp_path / "p.jsonl").write_text('{"input": "q"}\n')
    argv = [
        *("--actor.model_name_or_path", str(tmp_path / "model"), "--train.agent_path", str(tmp_path / "agent.py")),
        *("--data.prompt_dataset", str(tmp_path / "p.jsonl"), "--vllm.compilation_config", "FULL_DECODE_ONLY"),
    ]
    for own in (["--dry-run"], ["--run-dir", str(tmp_path / "run")]):
        with pytest.raises(SystemExit) as stop:
            cli.train_rl([*own, *argv])
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            "molt (the pods' flags): error: --vllm.compilation_config FULL_DECODE_ONLY: not JSON (Expecting value "
            "at character 0)"
        ]
    assert not (tmp_path / "run").exists()


def test_a_bad_trainer_flag_stops_the_stack_before_anything_starts(tmp_path, capsys):
    from molt.stack.up import StackPlan, run_plan

    plan = StackPlan(
        name="t",
        model=tmp_path / "model",
        agents={"a": tmp_path / "a.py"},
        agent="a",
        trainer=["--data.prompt_dataset", "/d", "--ckpt.max_mem", "0"],
        run_dir=tmp_path / "run",
    )
    with pytest.raises(SystemExit) as stop:
        run_plan(plan)
    assert stop.value.code == 2 and "--ckpt.max_mem must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing started, no run folder


def test_cpu_pods_get_an_explicit_kv_cache_and_fp32_which_the_dry_run_shows_and_a_flag_overrides(tmp_path, capsys):
    from molt import cli

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "agent.py").write_text("")
    base = ["--actor.model_name_or_path", str(tmp_path / "model"), "--train.agent_path", str(tmp_path / "agent.py")]
    rollout = tr.cpu_pod_defaults(tr.route(base, "local")).rollout
    assert rollout == ["--vllm.dtype", "float32", "--vllm.kv_cache_memory_bytes", str(256 << 20)]
    given = [*base, "--vllm.kv_cache_memory_bytes", "1000000", "--vllm.dtype", "bfloat16"]
    assert tr.cpu_pod_defaults(tr.route(given, "local")).rollout == given[4:]
    (tmp_path / "p.jsonl").write_text('{"input": "q"}\n')  # the dry run checks the dataset exists
    assert cli.train_rl(["--dry-run", *base, "--data.prompt_dataset", str(tmp_path / "p.jsonl")]) == 0  # no GPU here
    assert json.loads(capsys.readouterr().out)["rollout"] == rollout


def test_molt_up_set_passes_any_service_flag_written_without_its_dashes(monkeypatch):
    """argparse takes no option value starting with a dash, so README's `--set trainer actor.adam.lr=1e-3`
    form is the one that parses; each value gets its dashes back for the service."""
    from molt import cli
    from molt.stack import up

    seen = {}
    monkeypatch.setattr(up, "run_stack", lambda options: seen.update(options.extra) or {})
    argv = ["up", "--set", "trainer", "actor.adam.lr=1e-3", "train.num_steps=5", "--set", "rollout"]
    assert cli.main([*argv, "vllm.enforce_eager", "--steps", "3"]) == 0
    assert seen == {"trainer": ["--actor.adam.lr=1e-3", "--train.num_steps=5"], "rollout": ["--vllm.enforce_eager"]}
    # a value may follow its name as its own word; names keep their dashes, values never gain any
    assert cli.main(["up", "--set", "trainer", "actor.adam.lr", "1e-3", "train.force_on_policy", "true"]) == 0
    assert seen["trainer"] == ["--actor.adam.lr", "1e-3", "--train.force_on_policy", "true"]
    assert cli.set_words(["port", "8100", "data.prompt_dataset", "dir/p.jsonl", "sync"]) == [
        *("--port", "8100", "--data.prompt_dataset", "dir/p.jsonl", "--sync")
    ]


def test_molt_up_set_with_dashes_is_told_the_form_it_takes(capsys):
    from molt import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["up", "--set", "trainer", "--actor.adam.lr", "1e-3"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "--set takes flags without their dashes" in err and "--actor.adam.lr" in err


def test_molts_distillation_script_runs_without_an_agent_as_molt_supplies_one():
    """Molt's distillation script passes no --train.agent_path: on_policy_distill then serves the built-in
    one-completion agent (here molt.agents.distill_agent), locally and in the images."""
    import asyncio

    from molt.agents import load_agent_runner
    from molt.agents.distill_agent import AgentRunner, DistillationEnv

    base = ["--actor.model_name_or_path", "/m", "--algo.advantage.estimator", "on_policy_distill"]
    base += ["--ref.model_name_or_path", "/teacher"]
    local = tr.route(base, "local", gpus=0)
    assert local.agent_path is not None and Path(local.agent_path).name == "distill_agent.py"
    runner = load_agent_runner(local.agent_path)  # as the env workers load it: a module of its own
    assert type(runner).__name__ == AgentRunner.__name__ and runner.env_cls.__name__ == "DistillationEnv"
    helm = tr.route(base, "helm")
    assert trh.helm_values(helm)["envs"]["agents"] == {"agent": "molt/agents/distill_agent.py"}
    # relative to the env-worker image's WORKDIR (/app), where service.Dockerfile copies molt/agents from the
    # checkout (test_deploy_compose.py::test_env_worker_image_holds_every_agent_the_deployments_name)
    assert (SCRIPTS.parents[3] / helm.agent_path).exists()
    assert asyncio.run(DistillationEnv().step({})).reward == 0.0
    with pytest.raises(ValueError, match="--train.agent_path is required"):
        tr.route(["--actor.model_name_or_path", "/m"], "local", gpus=0)  # other estimators still need one

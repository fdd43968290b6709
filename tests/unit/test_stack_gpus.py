"""GPU placement of the local stack (`molt up`, `molt train-rl`): pods first, each on its tensor-parallel width,
then the trainer, one rank per GPU; too few GPUs is one line naming the flags before anything starts. This
machine has no GPU: the counts are stood in for, and the wiring test stops before any process starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from molt.stack import train_rl, up
from molt.stack.gpus import FLAGS, place, trainer_command, visible_gpus
from molt.stack.procs import ManagedProcess

UP = FLAGS["up"]
RL = FLAGS["train-rl"]


def test_pods_first_then_the_trainer_on_the_rest():
    p = place(["0", "1", "2", "3", "4", "5", "6", "7"], 2, 2, None, RL)
    assert p is not None
    assert p.pods == ["0,1", "2,3"]
    assert p.trainer == "4,5,6,7" and p.trainer_ranks == 4
    assert p.notes == []


def test_an_asked_for_trainer_count_is_honoured():
    p = place(["0", "1", "2", "3", "4", "5", "6", "7"], 4, 1, 2, RL)
    assert p is not None
    assert p.pods == ["0", "1", "2", "3"] and p.trainer == "4,5"


def test_no_gpus_pins_nothing():
    assert place([], 3, 1, None, UP) is None


def test_too_many_pods_is_one_line_naming_the_flags():
    with pytest.raises(ValueError) as e:
        place(["0", "1", "2", "3"], 3, 2, None, RL)
    assert str(e.value) == (
        "--vllm.num_engines 3 x --vllm.tensor_parallel_size 2: the rollout pods need 6 GPUs and this machine "
        "has 4; lower --vllm.num_engines"
    )


def test_a_trainer_count_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match=r"^--actor.num_gpus_per_node 4: the trainer needs 4 GPUs beside the "):
        place(["0", "1", "2", "3"], 2, 1, 4, RL)


def test_no_gpu_left_shares_the_last_pods_with_a_note():
    p = place(["0"], 1, 1, None, UP)
    assert p is not None
    assert p.pods == ["0"] and p.trainer == "0"
    assert "--set rollout vllm.gpu_memory_utilization" in p.notes[0]


def test_children_get_the_parents_own_gpu_names():
    """A child's CUDA_VISIBLE_DEVICES replaces its parent's: the names are the machine's, not indices into
    the parent's list."""
    assert visible_gpus(2, {}) == ["0", "1"]
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "3, 5"}) == ["3", "5"]
    assert visible_gpus(1, {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}) == ["GPU-aa"]
    assert visible_gpus(0, {"CUDA_VISIBLE_DEVICES": ""}) == []


def test_one_rank_is_the_module_and_more_run_under_torchrun():
    assert trainer_command(["--x", "1"], 1, 120) == [sys.executable, "-m", "services.trainer", "--x", "1"]
    cmd = trainer_command(["--x", "1"], 4, 120)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc-per-node=4" in cmd and "--standalone" in cmd
    assert cmd[-4:] == ["-m", "services.trainer", "--x", "1"]


def test_torchrun_takes_the_trainer_command():
    """The real torchrun parses the launch and starts two ranks of the trainer's module (each prints its help)."""
    cmd = trainer_command(["--help"], 2, 120)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("--actor.") >= 2


def test_train_rl_routes_the_trainer_gpu_count_on_a_gpu_machine():
    argv = ["--actor.model_name_or_path", "m", "--train.agent_path", "a.py", "--vllm.num_engines", "2"]
    r = train_rl.route([*argv, "--actor.num_gpus_per_node", "4"], "local", gpus=8)
    assert r.trainer_gpus == 4
    placed = train_rl.place_gpus(r, 8)
    assert placed is not None and placed.pods == ["0", "1"] and placed.trainer == "2,3,4,5"
    r = train_rl.route([*argv, "--actor.num_gpus_per_node", "7"], "local", gpus=8)
    with pytest.raises(ValueError, match="^molt train-rl:\n  --actor.num_gpus_per_node 7: the trainer needs 7"):
        train_rl.place_gpus(r, 8)
    assert train_rl.place_gpus(train_rl.route(argv, "local", gpus=0), 0) is None


def test_up_refuses_a_plan_that_does_not_fit_before_anything_starts(capsys):
    plan = up.StackPlan(name="tiny", model=Path("m"), agents={}, agent="tiny", num_pods=3)
    with pytest.raises(SystemExit) as e:
        up.gpu_placement(plan, count=2)
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "molt: error: --pods 3 x --set rollout vllm.tensor_parallel_size 1: the rollout pods need 3 GPUs and "
        "this machine has 2; lower --pods\n"
    )


def test_each_service_is_started_with_its_gpus(tmp_path, monkeypatch):
    """run_plan's wiring: every pod's CUDA_VISIBLE_DEVICES, and the trainer's GPUs and torchrun launch. The
    processes are recorded, not started; waiting for the trainer ends the run as Ctrl-C would."""
    made: dict[str, ManagedProcess] = {}

    def launch(_sup, make, ports):
        proc = make(*ports)
        made[proc.name] = proc
        return proc

    def settle(_sup, proc, ports, _make, _ready):
        if proc.name == "trainer":
            raise KeyboardInterrupt
        return proc, ports

    monkeypatch.setattr(up, "check_redis", lambda url: None)
    monkeypatch.setattr(up, "check_trainer_flags", lambda *a: None)
    monkeypatch.setattr(up, "check_service_flags", lambda *a: None)
    monkeypatch.setattr(up, "launch", launch)
    monkeypatch.setattr(up, "settle", settle)
    monkeypatch.setattr(up, "start_on_free_ports", lambda sup, n, make, ready: (launch(sup, make, [9000]), [9000]))
    monkeypatch.setattr(up, "gpu_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    plan = up.StackPlan(
        name="tiny",
        model=tmp_path / "m",
        agents={},
        agent="tiny",
        num_pods=2,
        rollout=["--vllm.tensor_parallel_size", "1"],
        run_dir=tmp_path / "run",
        redis_url="redis://127.0.0.1:1/0",
        progress=False,
    )
    assert up.run_plan(plan) == {"interrupted": True}
    assert made["rollout-0"].env["CUDA_VISIBLE_DEVICES"] == "4"
    assert made["rollout-1"].env["CUDA_VISIBLE_DEVICES"] == "5"
    assert "CUDA_VISIBLE_DEVICES" not in made["gateway"].env
    trainer = made["trainer"]
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert "--nproc-per-node=2" in trainer.cmd
    assert trainer.cmd[trainer.cmd.index("services.trainer") - 1 :][:2] == ["-m", "services.trainer"]
    # started with the pods, it was given their URLs and the env worker's before any of them was up
    rollout_urls = trainer.cmd[trainer.cmd.index("--rollout.urls") + 1].split(",")
    assert rollout_urls == [made[f"rollout-{i}"].ready_url for i in range(2)]
    assert trainer.cmd[trainer.cmd.index("--envs.urls") + 1] == made["envs"].ready_url


def test_molt_up_refuses_too_many_pods_before_it_builds_the_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(up, "gpu_count", lambda: 2)
    monkeypatch.setattr(up, "check_redis", lambda url: None)
    monkeypatch.setattr(up, "build_model", lambda *a: pytest.fail("molt up built the model"))
    with pytest.raises(SystemExit) as e:
        up.run_stack(up.UpOptions(recipe="tiny", num_pods=3, run_dir=tmp_path / "run"))
    assert e.value.code == 2 and capsys.readouterr().err.endswith("this machine has 2; lower --pods\n")

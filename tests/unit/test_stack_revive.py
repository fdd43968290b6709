"""Which services `molt up` starts again when they die mid-run, and with what (molt.stack.watch.revive)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from molt.stack import up, watch
from molt.stack.procs import ManagedProcess, ServiceFailed


class _Exited:
    def __init__(self, code: int) -> None:
        self.returncode = code

    def poll(self) -> int:
        return self.returncode


class _Sup:
    def __init__(self) -> None:
        self.restarted: list[str] = []

    def restart(self, p: ManagedProcess) -> None:
        self.restarted.append(p.name)


def _dead(name: str, code: int, tmp_path: Path) -> ManagedProcess:
    p = ManagedProcess(name, [name], tmp_path / f"{name}.log")
    p.proc = _Exited(code)  # type: ignore[assignment]  # a stand-in with poll() and returncode
    return p


def _checkpointed(tmp_path: Path, ckpt: bool) -> Callable[[], bool]:
    """`molt up`'s own test of the run's --ckpt.path, over a checkpoint folder that holds one or not."""
    root = tmp_path / "ckpt"
    if ckpt:
        (root / "global_step4").mkdir(parents=True)
        (root / "global_step4" / "extra_state.pt").write_bytes(b"")
        (root / "latest").write_text("global_step4")
    plan = up.StackPlan("t", tmp_path, {}, "t", trainer=["--ckpt.path", str(root)], cwd=str(tmp_path))
    return lambda: up._checkpointed(plan)


def test_a_pod_comes_back_out_of_routing_until_the_trainer_pushes_it_weights(tmp_path):
    sup, restarts = _Sup(), {}
    pod, trainer = _dead("rollout-0", -9, tmp_path), _dead("trainer", 0, tmp_path)
    watch.revive(sup, pod, trainer, restarts, _checkpointed(tmp_path, False))  # type: ignore[arg-type]
    assert sup.restarted == ["rollout-0"] and restarts == {"rollout-0": 1}
    assert pod.cmd[-2:] == ["--weights.await_push", "true"]
    watch.revive(sup, pod, trainer, restarts, _checkpointed(tmp_path, False))  # type: ignore[arg-type]
    assert pod.cmd.count("--weights.await_push") == 1 and restarts == {"rollout-0": 2}


def test_a_killed_trainer_comes_back_from_its_checkpoint(tmp_path):
    sup, restarts = _Sup(), {}
    trainer = _dead("trainer", -9, tmp_path)
    watch.revive(sup, trainer, trainer, restarts, _checkpointed(tmp_path, True))  # type: ignore[arg-type]
    assert sup.restarted == ["trainer"] and trainer.cmd[-2:] == ["--ckpt.load_enable", "true"]
    watch.revive(sup, trainer, trainer, restarts, lambda: True)  # type: ignore[arg-type]
    assert trainer.cmd.count("--ckpt.load_enable") == 1 and restarts == {"trainer": 2}


@pytest.mark.parametrize(
    ("name", "code", "restarts"),
    [
        ("trainer", 1, {}),  # its own error: a restart would meet it again
        ("gateway", 2, {}),  # a flag or a port: the same
        ("envs", 1, {"envs": watch.MAX_RESTARTS}),  # it keeps dying
    ],
)
def test_what_a_restart_would_not_fix_ends_the_run_naming_the_service(tmp_path, name, code, restarts):
    sup = _Sup()
    p = _dead(name, code, tmp_path)
    trainer = p if name == "trainer" else _dead("trainer", 0, tmp_path)
    with pytest.raises(ServiceFailed, match=rf"^{name} exited with code {code}"):
        watch.revive(sup, p, trainer, dict(restarts), _checkpointed(tmp_path, True))  # type: ignore[arg-type]
    assert sup.restarted == []

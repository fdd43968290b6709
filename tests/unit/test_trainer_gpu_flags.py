"""Trainer flags for NeMo AutoModel on GPU: handed to its loader there, refused with the reason where they cannot
run (CPU, --fsdp.strategy torch, vision-language models for Liger, sequence parallelism without TP).

--fsdp.use_liger_kernel is off unless asked (NeMo's loader would apply Liger by default); --fsdp.bf16_master_weights
loads the policy in bf16 (Molt's DeepSeek-V4 recipe). The NeMo loader is replaced by a recorder: this machine has
no GPU to build the real model on."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from molt.config import parse_settings
from molt.stack import train_rl as tr
from services.trainer import model
from services.trainer.config import TrainerSettings

GPU = model.DistInfo(rank=0, world_size=1, device=torch.device("cuda", 0), backend="nccl")
CPU = model.DistInfo(rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")


def _fsdp(*flags: str):
    return parse_settings(TrainerSettings, ["--train.dispatch", "false", *flags], prog="trainer").fsdp


def _model_dir(tmp_path, vision: bool) -> str:
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    if vision:
        config = {"model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.fixture
def nemo_calls(monkeypatch):
    import nemo_automodel
    from nemo_automodel.components.distributed import config as dist_config

    calls: list[dict] = []

    def record(cls, path, **kwargs):
        calls.append(kwargs)
        return torch.nn.Linear(1, 1)

    def build(cls, config, sizes, **kwargs):
        calls.append({"fsdp2_config": config, "sizes": sizes})
        return SimpleNamespace()

    monkeypatch.setattr(dist_config.DistributedSetup, "build", classmethod(build))
    for name in ("NeMoAutoModelForCausalLM", "NeMoAutoModelForImageTextToText"):
        monkeypatch.setattr(getattr(nemo_automodel, name), "from_pretrained", classmethod(record))
    return calls


@pytest.mark.parametrize(("flags", "expected"), [((), False), (("--fsdp.use_liger_kernel",), True)])
def test_the_gpu_loader_gets_the_flag_as_given(tmp_path, nemo_calls, flags, expected):
    model.load_causal_lm(_model_dir(tmp_path, vision=False), _fsdp(*flags), GPU)
    assert nemo_calls[1]["use_liger_kernel"] is expected


def test_a_vision_language_model_is_refused(tmp_path, nemo_calls):
    with pytest.raises(ValueError, match="text decoders only"):
        model.load_causal_lm(_model_dir(tmp_path, vision=True), _fsdp("--fsdp.use_liger_kernel"), GPU)
    assert not [c for c in nemo_calls if "use_liger_kernel" in c]


@pytest.mark.parametrize(("info", "strategy"), [(CPU, "auto"), (GPU, "torch")])
def test_without_nemo_on_gpu_it_is_refused_before_loading(tmp_path, info, strategy):
    fsdp = _fsdp("--fsdp.use_liger_kernel", "--fsdp.strategy", strategy)
    with pytest.raises(ValueError, match="drop the flag on CPU or with --fsdp.strategy torch"):
        model.load_causal_lm(_model_dir(tmp_path, vision=False), fsdp, info)


def test_train_rl_refuses_it_on_this_cpu_machine_and_routes_it_for_helm():
    argv = ["--actor.model_name_or_path", "/m", "--train.agent_path", "/a.py", "--fsdp.use_liger_kernel"]
    with pytest.raises(ValueError, match="--fsdp.use_liger_kernel: Liger's kernels are Triton"):
        tr.route(argv, "local", gpus=0)
    assert "--fsdp.use_liger_kernel" in tr.route(argv, "helm").trainer


@pytest.mark.parametrize(("flags", "dtype"), [((), torch.float32), (("--fsdp.bf16_master_weights",), torch.bfloat16)])
def test_bf16_master_weights_load_the_policy_in_bf16_on_gpu(tmp_path, nemo_calls, flags, dtype):
    model.load_causal_lm(_model_dir(tmp_path, vision=False), _fsdp(*flags), GPU)
    assert nemo_calls[1]["torch_dtype"] == dtype


def test_bf16_master_weights_are_refused_off_nemo_and_on_this_cpu_machine(tmp_path):
    with pytest.raises(ValueError, match="here the weights stay fp32: drop the flag"):
        model.load_causal_lm(_model_dir(tmp_path, vision=False), _fsdp("--fsdp.bf16_master_weights"), CPU)
    argv = ["--actor.model_name_or_path", "/m", "--train.agent_path", "/a.py", "--fsdp.bf16_master_weights"]
    with pytest.raises(ValueError, match="this machine has none"):
        tr.route(argv, "local", gpus=0)
    assert "--fsdp.bf16_master_weights" in tr.route(argv, "helm").trainer


def test_sequence_parallel_reaches_nemos_tp_plan_and_needs_tp():
    from services.trainer.checks import validate_settings

    flags = ["--fsdp.tp_size", "2", "--fsdp.sequence_parallel"]
    assert _fsdp(*flags).sequence_parallel
    s = parse_settings(
        TrainerSettings, ["--actor.model_name_or_path", "m", "--train.dispatch", "false", *flags], environ={}
    )
    validate_settings(s)
    with pytest.raises(ValueError, match="--fsdp.sequence_parallel shards activations inside TP"):
        validate_settings(
            parse_settings(
                TrainerSettings,
                ["--actor.model_name_or_path", "m", "--train.dispatch", "false", "--fsdp.sequence_parallel"],
                environ={},
            )
        )


def test_sequence_parallel_is_handed_to_nemos_fsdp2_config(tmp_path, nemo_calls):
    model.load_causal_lm(
        _model_dir(tmp_path, vision=False), _fsdp("--fsdp.tp_size", "2", "--fsdp.sequence_parallel"), GPU
    )
    assert nemo_calls[0]["fsdp2_config"].sequence_parallel is True and nemo_calls[0]["sizes"].tp_size == 2


def test_lora_reaches_nemos_loader_as_its_peft_config(tmp_path, nemo_calls):
    lora = SimpleNamespace(rank=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"])
    model.load_causal_lm(_model_dir(tmp_path, vision=False), _fsdp(), GPU, lora=lora)
    peft = nemo_calls[1]["peft_config"]
    assert type(peft) is model._nemo_peft_config()
    assert (peft.dim, peft.alpha, peft.dropout, peft.target_modules) == (4, 8, 0.1, ["q_proj", "v_proj"])


def test_nemos_public_peft_config_is_preferred_where_the_release_has_it(monkeypatch):
    """nemo_automodel.shared.peft_config (NeMo's documented module after 0.7.0) wins over the private fallback."""
    import sys
    from types import ModuleType

    public = ModuleType("nemo_automodel.shared.peft_config")

    class PeftConfig:
        pass

    public.PeftConfig = PeftConfig  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nemo_automodel.shared.peft_config", public)
    assert model._nemo_peft_config() is PeftConfig


def test_unset_attention_is_flash_on_gpu_only_where_flash_attn_is_installed(monkeypatch):
    """The images ship without flash-attn: a GPU trainer started with no --fsdp.attn_implementation loads on
    sdpa there instead of failing, and picks flash_attention_2 where it is installed."""
    import importlib.util

    real = importlib.util.find_spec

    def installed(flash: bool):
        def find_spec(name, *args):
            return (object() if flash else None) if name == "flash_attn" else real(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    installed(False)
    assert model._attn(_fsdp(), True) == "sdpa" and model._attn(_fsdp(), False) == "sdpa"
    installed(True)
    assert model._attn(_fsdp(), True) == "flash_attention_2" and model._attn(_fsdp(), False) == "sdpa"
    assert model._attn(_fsdp("--fsdp.attn_implementation", "eager"), True) == "eager"


@pytest.mark.parametrize(("mode", "given"), [("full", True), ("off", False), ("selective", "selective")])
def test_the_activation_checkpoint_mode_reaches_nemos_fsdp2_config(tmp_path, nemo_calls, mode, given):
    model.load_causal_lm(_model_dir(tmp_path, vision=False), _fsdp(), GPU, gradient_checkpoint=mode)
    assert nemo_calls[0]["fsdp2_config"].activation_checkpointing == given


def test_offload_is_refused_where_nothing_would_offload(tmp_path):
    """NeMo AutoModel offloads; the CPU path has nothing to offload to, and says so rather than ignoring it."""
    with pytest.raises(ValueError, match="--fsdp.offload optimizer: CPU offload is NeMo AutoModel's"):
        model.load_causal_lm(_model_dir(tmp_path, vision=False), _fsdp("--fsdp.offload", "optimizer"), CPU)
    argv = ["--actor.model_name_or_path", "/m", "--train.agent_path", "/a.py", "--fsdp.offload", "optimizer"]
    with pytest.raises(ValueError, match="this machine has none"):
        tr.route(argv, "local", gpus=0)
    assert "--fsdp.offload" in tr.route(argv, "helm").trainer

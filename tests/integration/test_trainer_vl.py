"""The trainer trains the tiny VLM on trajectories a real pod (vLLM, fp32) produced with images.

A gateway in front of the pod records one group of two episodes: sample 0 shows images in two turns
of a three-turn chat, sample 1 is text only. The trainer feeds the recorded image files through the
model's processor next to the recorded tokens, so its forward reproduces the pod's logprobs (< 1e-4
per token, fp32). ``--actor.freeze_visual_encoder`` leaves the vision tower unchanged by a step while
the connector and the language model move. The real CLI on two gloo ranks trains the same group: one
rank gets the image episode, the other the text-only one, and FSDP2's gradient reduction over the
vision tower must still line up (the text-only rank runs it on a blank image).
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from vl_testlib import data_url, image_bytes

from molt.config import parse_settings
from services.trainer.batch import samples_from_trajectory
from services.trainer.checks import validate_settings
from services.trainer.config import TrainerSettings
from services.trainer.learner import Learner
from services.trainer.model import full_state_dict, init_distributed
from tests.gateway_testlib import pod_and_gateway, read_trajectories
from tests.integration.trainer_testlib import audit, run_trainer

pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.timeout(600)]
TOL = 1e-4
VISION = "model.vision_model."


def _session(url: str, group: str, index: int) -> dict:
    body = {"group_id": group, "sample_index": index, "sampling_params": {"temperature": 1.0, "seed": 11 + index}}
    r = httpx.post(url + "/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def _finish(url: str, sid: str, reward: float) -> None:
    r = httpx.post(f"{url}/v1/sessions/{sid}/finish", json={"reward": reward})
    assert r.status_code == 200 and r.json()["written"] is True, r.text


def _image_episode(url: str, group: str) -> None:
    session = _session(url, group, 0)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key="x")
    image = {"type": "image_url", "image_url": {"url": data_url(image_bytes(1))}}
    messages: list[dict] = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    for turn in (
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(2, fmt="JPEG"), "image/jpeg")}},
        None,
    ):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        content = [turn, {"type": "text", "text": "And now?"}] if turn else "Compare them."
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": content}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=6)
    _finish(url, session["session_id"], 1.0)


def _text_episode(url: str, group: str) -> None:
    session = _session(url, group, 1)
    client = openai.OpenAI(base_url=session["openai_base_url"], api_key="x")
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Describe a cat."}], max_tokens=6)
    _finish(url, session["session_id"], 0.0)


@pytest.fixture(scope="module")
def recorded(tiny_idefics3, redis_url, tmp_path_factory):
    """The stream holding one group (image episode, text episode) the real pod generated."""
    logs = tmp_path_factory.mktemp("trainer-vl")
    with pod_and_gateway(tiny_idefics3, logs, redis_url, "trainer-vl", max_length=512) as (url, _, stream):
        _image_episode(url, "g0")
        _text_episode(url, "g0")
        trajs = sorted(read_trajectories(redis_url, stream), key=lambda t: t.sample_index)
        assert [t.sample_index for t in trajs] == [0, 1] and len(trajs[0].images) == 2 and not trajs[1].images
        yield {"stream": stream, "trajectories": trajs}


def _flags(model, *extra: str) -> list[str]:
    return [
        "--actor.model_name_or_path",
        str(model),
        "--train.dispatch",
        "false",
        "--algo.kl.init_coef",
        "0",
        "--algo.advantage.estimator",
        "grpo",
        "--rollout.n_samples_per_prompt",
        "2",
        "--rollout.batch_size",
        "1",
        "--train.batch_size",
        "2",
        "--train.micro_batch_size",
        "1",
        "--actor.adam.lr",
        "1e-2",
        "--actor.max_norm",
        "100",
        *extra,
    ]


def _step(model, trajectories, freeze: bool):
    """One in-process step (a world of one): per-sample trainer logprobs, and the weights before and after."""
    s = parse_settings(
        TrainerSettings, _flags(model, *(["--actor.freeze_visual_encoder"] if freeze else [])), environ={}
    )
    validate_settings(s)
    info = init_distributed()
    try:
        learner = Learner(s, info)
        # Shared-prefix packing (on by default) is off for a VL policy: images need the plain token layout.
        assert s.train.pack_shared_prefix and learner.packing is False
        samples = [x for t in trajectories for x in samples_from_trajectory(t, s.data.max_len, learner.vision)]
        before = {k: v.clone() for k, v in full_state_dict(learner.actor).items()}
        learner.train_step(samples)  # its experience pass stores the pre-step logprobs as old_logp
        return learner.frozen_names, samples, before, full_state_dict(learner.actor)
    finally:
        dist.destroy_process_group()


def _moved(before, after, prefix: str) -> list[str]:
    return [k for k in before if k.startswith(prefix) and not torch.equal(before[k], after[k])]


def test_trainer_logprobs_match_the_pod_on_image_turns_and_the_frozen_tower_stays(tiny_idefics3, recorded):
    frozen, samples, before, after = _step(tiny_idefics3, recorded["trajectories"], freeze=True)
    image_sample = samples[0]
    assert len(image_sample.images) == 2 and int(image_sample.action_mask.sum()) > 0
    for x in samples:
        assert x.old_logp is not None
        diff = (x.old_logp - x.rollout_logp)[x.action_mask].abs()
        assert float(diff.max()) < TOL, (x.trajectory_id, float(diff.max()))
    tower = sorted(k for k in before if k.startswith(VISION))
    assert tower and frozen == tower  # excluded from the optimizer and from weight sync
    assert _moved(before, after, VISION) == []
    assert _moved(before, after, "model.connector.") and _moved(before, after, "model.text_model.layers.")


def test_without_the_freeze_the_step_moves_the_vision_tower(tiny_idefics3, recorded):
    frozen, _, before, after = _step(tiny_idefics3, recorded["trajectories"], freeze=False)
    assert frozen == [] and _moved(before, after, VISION)


@pytest.mark.slow
def test_two_gloo_ranks_train_an_image_episode_and_a_text_episode(tiny_idefics3, recorded, redis_url, tmp_path):
    # Tower trainable: the image rank has gradients on it, so the text rank must produce (zero) ones too.
    flags = _flags(tiny_idefics3, "--train.num_steps", "1", "--redis.url", redis_url, "--redis.stream")
    flags += [recorded["stream"], "--ckpt.path", str(tmp_path / "ckpt"), "--ckpt.save_steps", "1"]
    flags += ["--logger.steps_jsonl", str(tmp_path / "steps.jsonl")]
    proc = run_trainer(flags, nproc=2, timeout=300)
    assert "rank 1 of 2 ready (gloo" in proc.stderr
    [step] = audit(tmp_path / "steps.jsonl")
    assert sorted(step["trajectory_ids"]) == sorted(t.trajectory_id for t in recorded["trajectories"])
    assert abs(step["mismatch_kl_fresh"]) < TOL, step  # the pod's weights, the pod's images: same numbers
    dcp_to_torch_save(str(tmp_path / "ckpt" / "global_step1" / "model_optim"), str(tmp_path / "w.pt"))
    trained = torch.load(tmp_path / "w.pt", weights_only=False)["actor"]
    base = load_file(str(tiny_idefics3 / "model.safetensors"))
    for prefix in (VISION, "model.connector.", "model.text_model.layers."):
        assert any(not torch.equal(trained[k], base[k]) for k in base if k.startswith(prefix)), prefix

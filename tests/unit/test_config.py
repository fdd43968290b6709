"""Dotted flags, env overrides, help text from docstrings, unknown-flag suggestions, --dry-run."""

import json
from typing import Literal

import pytest

from molt.config import RedisConfig, Section, build_parser, parse_settings


class Advantage(Section):
    estimator: Literal["reinforce", "grpo", "rloo"] = "reinforce"
    """Advantage estimator."""
    is_correction_threshold: list[float] = [0.5, 5.0]
    """IS band LOW HIGH."""
    no_whiten: bool = False
    """Skip whitening."""


class Algo(Section):
    advantage: Advantage = Advantage()
    """Advantages."""


class Rollout(Section):
    n_samples_per_prompt: int = 1
    """Samples per prompt."""


class Settings(Section):
    """Test service."""

    algo: Algo = Algo()
    rollout: Rollout = Rollout()
    redis: RedisConfig = RedisConfig()


def test_dotted_flags_and_types():
    s = parse_settings(
        Settings,
        [
            "--algo.advantage.estimator",
            "grpo",
            "--rollout.n_samples_per_prompt",
            "8",
            "--algo.advantage.is_correction_threshold",
            "0.99",
            "1.01",
            "--algo.advantage.no_whiten",
        ],
        environ={},
    )
    assert s.algo.advantage.estimator == "grpo"
    assert s.rollout.n_samples_per_prompt == 8
    assert s.algo.advantage.is_correction_threshold == [0.99, 1.01]
    assert s.algo.advantage.no_whiten is True


def test_bool_forms():
    assert (
        parse_settings(Settings, ["--algo.advantage.no_whiten", "false"], environ={}).algo.advantage.no_whiten is False
    )
    s = parse_settings(Settings, ["--no-algo.advantage.no_whiten"], environ={"MOLT_ALGO__ADVANTAGE__NO_WHITEN": "1"})
    assert s.algo.advantage.no_whiten is False


def test_layering_defaults_env_flags():
    env = {
        "MOLT_REDIS__URL": "redis://env:1/0",
        "MOLT_ROLLOUT__N_SAMPLES_PER_PROMPT": "4",
        "MOLT_ALGO__ADVANTAGE__IS_CORRECTION_THRESHOLD": "0.8,1.2",
    }
    s = parse_settings(Settings, ["--rollout.n_samples_per_prompt", "16"], environ=env)
    assert s.redis.url == "redis://env:1/0"  # env over default
    assert s.rollout.n_samples_per_prompt == 16  # flag over env
    assert s.algo.advantage.is_correction_threshold == [0.8, 1.2]
    assert s.redis.stream == "molt:trajectories"  # default


def test_help_shows_field_docstrings(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_settings(Settings, ["--help"], environ={})
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--algo.advantage.estimator" in out and "Advantage estimator." in out
    assert "Name of the trajectory stream." in out


def test_unknown_flag_suggests_closest(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_settings(Settings, ["--algo.advantage.estimater", "grpo"], environ={})
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "did you mean --algo.advantage.estimator?" in err


def test_bad_value_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_settings(Settings, ["--rollout.n_samples_per_prompt", "many"], environ={})
    assert "--rollout.n_samples_per_prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(Settings, ["--algo.advantage.estimator", "ppo"], environ={})
    assert "invalid choice" in capsys.readouterr().err


def test_dry_run_prints_resolved_config(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_settings(Settings, ["--dry-run", "--rollout.n_samples_per_prompt", "3"], environ={})
    assert exit_.value.code == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["rollout"]["n_samples_per_prompt"] == 3
    assert resolved["algo"]["advantage"]["estimator"] == "reinforce"


def test_parser_lists_every_leaf():
    text = build_parser(Settings, "x").format_help()
    for flag in ("--redis.url", "--redis.max_len", "--algo.advantage.is_correction_threshold"):
        assert flag in text


def test_short_flags_expand_only_where_the_target_exists():
    from molt.config import ModelConfig, ServerConfig

    class Pod(Section):
        model: ModelConfig = ModelConfig()
        server: ServerConfig = ServerConfig()

    s = parse_settings(Pod, ["--model", "/m", "--port=8100", "--host", "0.0.0.0"], environ={})
    assert (s.model.path, s.server.port, s.server.host) == ("/m", 8100, "0.0.0.0")

    class Push(Section):
        model: str = ""  # a flag of its own: left alone

    assert parse_settings(Push, ["--model", "/m"], environ={}).model == "/m"


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("actor.learning_rate", "actor.adam.lr"),  # OpenRLHF's and TRL's name
        ("train.lr", "actor.adam.lr"),
        ("critic.lr", "critic.adam.lr"),
        ("train.save_steps", "ckpt.save_steps"),  # the right name in another section
        ("rollout.temperatur", "rollout.temperature"),  # a typo
        ("algo.advantage.estimtor", "algo.advantage.estimator"),
        ("nothing.like_it_at_all", None),
    ],
)
def test_an_unknown_flag_is_told_the_one_it_most_likely_meant(typed, meant):
    from molt.config import iter_fields, suggest_flag
    from services.trainer.config import TrainerSettings

    known = [d for d, _, _ in iter_fields(TrainerSettings)]
    assert suggest_flag(typed, known) == meant

"""Molt's Ray workers inherit the launching shell, and its example agents read settings from it (geo3k's
MAX_AGENT_TURNS, its tool's PYTHON_EXECUTOR_*): `molt train-rl --emit helm-values` writes the variables the
agent's code reads and the shell sets into envs.extraEnv, secrets excepted, so a chart run plays as many turns
as the local one."""

from __future__ import annotations

from pathlib import Path

from deploy import tools
from molt.stack import train_rl as tr
from molt.stack import train_rl_helm as trh
from molt.stack.agent_env import engine_imports, forwarded_env, read_names

EXAMPLES = Path(__file__).resolve().parents[1] / "fixtures" / "molt_examples"
GEO3K = EXAMPLES / "agents" / "geo3k.py"
SHELL = {"MAX_AGENT_TURNS": "10", "PYTHON_EXECUTOR_TIMEOUT": "5", "OPENAI_API_KEY": "sk-123", "MODEL_PATH": "/m"}


def test_the_names_come_from_the_agent_and_the_files_beside_it(tmp_path):
    assert {"MAX_AGENT_TURNS", "VLLM_TOOL_PARSER_CLS"} <= read_names(GEO3K)  # the agent itself
    assert "PYTHON_EXECUTOR_TIMEOUT" in read_names(GEO3K)  # its tool, loaded from ../tools by path
    agent = tmp_path / "a" / "agent.py"
    agent.parent.mkdir()
    agent.write_text('import os\nA = os.getenv("ALPHA")\nB = os.environ["BETA"]\nC = os.environ.get(name)\n')
    assert read_names(agent) == {"ALPHA", "BETA"}  # only literal names
    assert read_names(tmp_path / "missing.py") == set()


def test_set_variables_are_forwarded_and_secrets_withheld():
    forwarded, withheld = forwarded_env(GEO3K, {**SHELL, "UNRELATED": "1", "MOLT_X": "1"})
    assert forwarded == [{"name": "MAX_AGENT_TURNS", "value": "10"}, {"name": "PYTHON_EXECUTOR_TIMEOUT", "value": "5"}]
    assert withheld == []  # geo3k reads no key; MODEL_PATH is the chart's own


def test_the_values_file_gives_the_env_workers_the_shells_settings(tmp_path):
    r = tr.route(["--actor.model_name_or_path", "/models/m", "--train.agent_path", str(GEO3K)], "helm")
    env = {**SHELL, "HELPER_API_TOKEN": "t-1"}
    assert trh.helm_values(r, env)["envs"]["extraEnv"] == [
        {"name": "MAX_AGENT_TURNS", "value": "10"},
        {"name": "PYTHON_EXECUTOR_TIMEOUT", "value": "5"},
    ]
    notes = trh.write_helm_values(r, tmp_path / "values.yaml", environ=env)
    assert any(n.startswith("envs.extraEnv: MAX_AGENT_TURNS, PYTHON_EXECUTOR_TIMEOUT") for n in notes)
    assert "sk-123" not in (tmp_path / "values.yaml").read_text()
    [envs] = [
        {e["name"]: e.get("value") for e in c.get("env", [])}
        for d in tools.render(str(tmp_path / "values.yaml"))
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-envs")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    assert envs["MAX_AGENT_TURNS"] == "10" and envs["PYTHON_EXECUTOR_TIMEOUT"] == "5"
    assert trh.helm_values(r, {})["envs"].get("extraEnv") is None


def test_an_agent_that_imports_torch_or_vllm_runs_in_the_rollout_image(tmp_path):
    """Molt's examples import torch at load (geo3k also vLLM's tool parser, by a dotted class path): the slim
    env-worker image lacks both, so the emitted values run the env workers in the rollout image."""
    assert engine_imports(GEO3K) == {"torch", "vllm"} and engine_imports(EXAMPLES / "agents" / "math.py") == {"torch"}
    assert engine_imports(Path(__file__).resolve().parents[2] / "examples" / "agents" / "judge.py") == set()
    r = tr.route(["--actor.model_name_or_path", "/models/m", "--train.agent_path", str(GEO3K)], "helm")
    assert trh.helm_values(r, {})["envs"]["image"] == {"repository": "molt-rollout"}
    notes = trh.write_helm_values(r, tmp_path / "values.yaml", environ={})
    assert any(n.startswith("envs.image.repository: molt-rollout, as the agent imports torch and vllm") for n in notes)
    [image] = [
        c["image"]
        for d in tools.render(str(tmp_path / "values.yaml"))
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-envs")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    assert image.startswith("molt-rollout:")
    slim = tmp_path / "agents" / "plain.py"
    slim.parent.mkdir()
    slim.write_text("from molt.agents import Env\nPARSER = 'json.decoder.JSONDecoder'\n")
    r = tr.route(["--actor.model_name_or_path", "/models/m", "--train.agent_path", str(slim)], "helm")
    assert "image" not in trh.helm_values(r, {})["envs"]


def test_a_secret_the_agent_reads_is_named_in_the_notes_not_written(tmp_path):
    agent = tmp_path / "agents" / "judge.py"
    agent.parent.mkdir()
    agent.write_text('import os\nKEY = os.environ["JUDGE_API_KEY"]\nN = os.getenv("JUDGE_SAMPLES")\n')
    r = tr.route(["--actor.model_name_or_path", "/m", "--train.agent_path", str(agent)], "helm")
    env = {"JUDGE_API_KEY": "k-999", "JUDGE_SAMPLES": "3"}
    notes = trh.write_helm_values(r, tmp_path / "values.yaml", environ=env)
    assert "k-999" not in (tmp_path / "values.yaml").read_text()
    assert any(n.startswith("JUDGE_API_KEY: read by the agent's code but not written") for n in notes)
    assert trh.helm_values(r, env)["envs"]["extraEnv"] == [{"name": "JUDGE_SAMPLES", "value": "3"}]

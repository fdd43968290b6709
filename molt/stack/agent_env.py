"""What an agent module needs from the machine it runs on, for env workers on Kubernetes: the launching shell's
variables it reads, and the libraries it imports that the slim env-worker image lacks.

Molt's Ray workers inherit the environment of the shell that ran the launch script, and its example agents
read settings from it (``MAX_AGENT_TURNS``, ``VLLM_TOOL_PARSER_CLS``, ``PYTHON_EXECUTOR_TIMEOUT``, ...). Local
env workers inherit it here too; on Kubernetes they do not, so ``molt train-rl --emit helm-values`` forwards
each variable that is set now and that the agent's code reads by a literal name (``os.environ[...]``,
``os.environ.get(...)``, ``os.getenv(...)``). The code read is every ``.py`` file in the agent's folder and
beside it (Molt's agents load their tools and graders from sibling folders by path). Names that look like
secrets are not written to a values file; the notes say how to give them from a Secret.

Molt's example agents import torch (and geo3k vLLM's tool parser, by a dotted class path) at load: the slim
``molt-service`` image has neither, the rollout image has both (it needs no GPU to import them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

# os.environ["X"], os.environ.get("X"), environ.get("X"), os.getenv("X"), os.environ.setdefault("X")
_READ = re.compile(
    r"""(?:environ\s*(?:\.\s*(?:get|setdefault)\s*\(|\[)|getenv\s*\()\s*["']([A-Za-z_][A-Za-z0-9_]*)["']"""
)
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# Set by the chart or the env worker itself: forwarding the launching machine's value would be wrong there.
_OWN = {"MODEL_PATH", "HOME", "PATH", "PWD", "USER", "HOSTNAME", "PYTHONPATH", "CUDA_VISIBLE_DEVICES"}
_MAX_FILES = 500
# Top-level modules of ``import X`` / ``from X import``, and dotted class paths in strings ("vllm.a.B").
_IMPORT = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", re.MULTILINE)
_DOTTED = re.compile(r"""["']([A-Za-z_]\w*)\.[A-Za-z_][\w.]*["']""")
ENGINE_MODULES = {"torch", "vllm"}
"""What the rollout image has and the slim env-worker image lacks."""


def _code(agent_path: str | Path) -> list[str]:
    """The text of the agent's ``.py`` file, its folder's, its parent's and their subfolders' one level down (at
    most ``_MAX_FILES`` files); empty when the agent file does not exist here."""
    agent = Path(agent_path).expanduser().resolve()
    if not agent.is_file():
        return []
    parent = agent.parent.parent
    files = {agent, *agent.parent.glob("*.py"), *parent.glob("*.py"), *parent.glob("*/*.py")}
    texts = []
    for path in sorted(files)[:_MAX_FILES]:
        try:
            texts.append(path.read_text(errors="replace"))
        except OSError:
            continue
    return texts


def read_names(agent_path: str | Path) -> set[str]:
    """The variable names the agent's code reads by a literal name."""
    return {name for text in _code(agent_path) for name in _READ.findall(text)}


def engine_imports(agent_path: str | Path) -> set[str]:
    """The modules of ``ENGINE_MODULES`` the agent module itself imports, by statement or by a dotted class path
    (its neighbours are other agents as often as its helpers)."""
    agent = Path(agent_path).expanduser()
    text = agent.read_text(errors="replace") if agent.is_file() else ""
    return {*_IMPORT.findall(text), *_DOTTED.findall(text)} & ENGINE_MODULES


def forwarded_env(agent_path: str | Path, environ: Mapping[str, str]) -> tuple[list[dict], list[str]]:
    """(``envs.extraEnv`` entries for the variables the agent reads that ``environ`` sets, the names withheld as
    secrets), both sorted by name."""
    wanted = sorted(n for n in read_names(agent_path) if n in environ and n not in _OWN and not n.startswith("MOLT_"))
    secret = [n for n in wanted if _SECRET.search(n)]
    return [{"name": n, "value": environ[n]} for n in wanted if n not in secret], secret

"""Docs are promises: every dotted flag that README.md or docs/ names is a flag some entry point accepts, or one
`molt train-rl` knows by name (wiring, placement, or missing with its reason)."""

import pathlib
import re
import sys

from molt.config import iter_fields
from molt.stack import train_rl
from services.envs.config import EnvsSettings
from services.gateway.config import GatewaySettings
from services.rollout.config import RolloutSettings
from services.trainer.config import TrainerSettings
from services.trainer.sft_config import SftSettings

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLAG = re.compile(r"--[a-z][a-z0-9_]*(?:\.[a-z0-9_]+)+\*?")  # a trailing * names a family of flags


def known_flags() -> set[str]:
    settings = (EnvsSettings, GatewaySettings, RolloutSettings, TrainerSettings, SftSettings)
    named = {
        *train_rl.WIRING,
        *train_rl.PLACEMENT,
        *train_rl.TRAINER_PLACEMENT,
        *train_rl.MISSING,
        *train_rl.POD_FLAGS,
        *train_rl.GATEWAY_FLAGS,
        *train_rl.ALIASES,
        train_rl.LEGACY_IS_ENABLE,
        train_rl.LEGACY_IS_TYPE,
    }
    return {"--" + dotted for s in settings for dotted, _, _ in iter_fields(s)} | {"--" + n for n in named}


def documented_flags() -> list[tuple[str, str, str]]:
    """(file, flag, the line it is on) for every dotted flag in README.md and docs/*.md."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in path.read_text().splitlines():
            out += [(path.name, flag, line) for flag in FLAG.findall(line)]
    return out


def test_every_documented_flag_exists():
    known = known_flags()
    groups = {k.rsplit(".", i)[0] for k in known for i in range(1, k.count(".") + 1)}

    def exists(flag: str) -> bool:
        if flag.endswith("*"):
            return any(k.startswith(flag[:-1]) for k in known)
        return flag in known or flag in groups

    missing = [(f, flag) for f, flag, line in documented_flags() if not exists(flag) and "did you mean" not in line]
    assert not missing, f"documented flags that no service accepts: {missing}"


def _section_paths(title: str) -> set[str]:
    """Every URL path docs/contracts.md names in the section whose heading starts with ``title``."""
    text = (ROOT / "docs" / "contracts.md").read_text()
    body = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    return {
        p.rstrip(".,;:")
        for p in re.findall(r"(?<![\w.])/(?:s/\{id\}/)?(?:v1/[\w/{}:.-]*|healthz|readyz|metrics)", body)
    }


def _served(app, path: str) -> bool:
    from starlette.routing import Match

    concrete = path.replace("{id}", "abc")
    for route in app.routes:
        for method in ("GET", "POST", "DELETE", "PUT"):
            scope = {"type": "http", "path": concrete, "method": method, "root_path": ""}
            if route.matches(scope)[0] != Match.NONE:
                return True
    return False


def _unserved(app, title: str) -> list[str]:
    paths = _section_paths(title)
    assert paths, f"docs/contracts.md: no paths found under {title!r}"
    return sorted(p for p in paths if not _served(app, p))


def test_every_flag_has_the_help_text_readme_promises():
    """README: each service's --help lists every flag with its docstring (pydantic's attribute docstrings)."""
    from services.trainer.push import PushSettings

    settings = (EnvsSettings, GatewaySettings, RolloutSettings, TrainerSettings, SftSettings, PushSettings)
    bare = [f"{s.__name__}: --{d}" for s in settings for d, _, info in iter_fields(s) if not (info.description or "")]
    assert bare == []


def test_every_rollout_endpoint_in_contracts_is_served():
    from services.rollout.app import build_app
    from tests.unit.test_rollout_routes import FakeEngine

    app = build_app(RolloutSettings.model_validate({"model": {"path": "/fake"}}), engine=FakeEngine())
    assert _unserved(app, "Rollout pod") == []


def test_every_gateway_endpoint_in_contracts_is_served(tiny_qwen3):
    from molt.bus.memory import MemoryTrajectoryQueue
    from services.gateway.app import build_app
    from services.gateway.chat import ChatModel
    from tests.gateway_testlib import FakePods

    pods = ["http://pod-a"]
    settings = GatewaySettings.model_validate({"model": {"path": str(tiny_qwen3)}, "rollout": {"urls": pods}})
    app = build_app(
        settings,
        transport=FakePods(pods, lambda prompt, sp: []),
        model=ChatModel(tiny_qwen3),
        queue=MemoryTrajectoryQueue(),
    )
    assert _unserved(app, "Gateway") == []


def test_every_env_worker_endpoint_in_contracts_is_served():
    from services.envs.app import build_app

    settings = EnvsSettings.model_validate(
        {"gateway": {"url": "http://gateway"}, "agent": [f"math={ROOT / 'examples' / 'agents' / 'math.py'}"]}
    )
    assert _unserved(build_app(settings), "Env worker") == []


def test_readme_data_path_table_names_code_that_exists():
    """Each `Class.method` in README's data-path table is defined in the file named before it in its row."""
    text = (ROOT / "README.md").read_text()
    table = text.split("Each arrow of the diagram, and the code that does it:", 1)[1].strip().split("\n\n", 1)[0]
    checked = 0
    for row in table.splitlines()[2:]:
        current = None
        for token in re.findall(r"`([^`]+)`", row.split("|")[2]):
            if token.endswith(".py"):
                current = ROOT / token if "/" in token else current.parent / token
                assert current.exists(), f"README names {token}, which does not exist"
            elif re.fullmatch(r"[A-Z]\w+\.\w+", token):
                cls, meth = token.split(".")
                assert current is not None
                source = current.read_text()
                assert f"class {cls}" in source and re.search(rf"def {meth}\b", source), f"{token} not in {current}"
                checked += 1
    assert checked >= 8


def test_nothing_cites_a_document_outside_the_repository():
    """Code and docs state the rule they follow; a section number of a reference that ships elsewhere
    ("spec 4.3", "molt-spec", "cpu-stack.md", "peers.md") tells a reader nothing they can open."""
    cite = re.compile(r"\bspec \d|molt-spec|cpu-stack|peers\.md|\.\./shared|§")
    folders = ("molt", "services", "bench", "deploy", "docs", "examples", "scripts", "tests", "proto")
    suffixes = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".proto", ".tpl", ".json"}
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "docker-compose.yml", ROOT / "pyproject.toml"]
    files += [p for f in folders for p in (ROOT / f).rglob("*") if p.suffix in suffixes and "fixtures" not in p.parts]
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in files
        if p != pathlib.Path(__file__).resolve()
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if cite.search(line)
    ]
    assert found == []


def test_every_benchmark_command_runs_a_bench_that_takes_its_flags():
    """BENCHMARKS.md's commands are what a reader re-runs: each names a script under bench/ whose parser declares
    every flag the command passes (soak rows pass bench/soak.py's flags); a table cell stays a figure, not a diary."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    commands = re.findall(r"`python (?:-m bench\.(\w+)|bench/(\w+)\.py)([^`]*)`", text)
    soak = re.findall(r"^\| `(--[^`]*)`", text, flags=re.M)
    runs = [(m or f, args) for m, f, args in commands] + [("soak", args) for args in soak]
    assert len(commands) >= 15 and len(soak) >= 5
    handed = {"gateway": GatewaySettings, "pod": RolloutSettings}
    for script, args in runs:
        # A service flag handed through (--gateway-arg=--x.y): the service, not the bench, must take it.
        for service, flag in re.findall(r"--(gateway|pod)-arg[= ](--[a-z][\w.]*)", args):
            assert flag in {"--" + d for d, _, _ in iter_fields(handed[service])}, f"the {service} has no {flag}"
        args = re.sub(r"(--(?:gateway|pod)-arg)[= ]--\S+", r"\1", args)
        source = (ROOT / "bench" / f"{script}.py").read_text()
        for flag in re.findall(r"--[a-z][a-z0-9-]*", args):
            assert f'"{flag}"' in source, f"bench/{script}.py has no {flag}"
    cells = [c for line in text.splitlines() if line.startswith("|") for c in line.split("|")]
    assert max(map(len, cells)) <= 300


def test_benches_run_as_modules_and_none_is_named_like_a_stdlib_module():
    """Benches run as ``python -m bench.X`` from the root; run as a script, bench/ would come first on sys.path,
    where a file named like a stdlib module (queue.py) shadows it for every library the bench imports."""
    names = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert not names & set(sys.stdlib_module_names)
    for p in (ROOT / "bench").glob("*.py"):
        text = p.read_text()
        assert "sys.path" not in text and "python bench/" not in text, p.name
    assert "python bench/" not in (ROOT / "BENCHMARKS.md").read_text()

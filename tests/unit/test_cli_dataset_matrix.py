"""Every entry point that reads a dataset refuses a bad one the same way, before any model loads or service
starts: status 2 and one line, ``<prog>: error: <flag> <path>: <problem>``. Entry points: `molt up --set trainer
data.prompt_dataset=...`, `molt train-rl`, `python -m services.trainer` (its prompts and --eval.dataset) and
`molt train-sft` (--data.dataset, --eval.dataset). Each runs in this process (the check is what is under test);
one subprocess per entry point shows the exit status a shell sees. A bad line deep in a file is found only by
reading it all: the check passes it, and the run's error names the file and the line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import datasets
import pytest

ROOT = Path(__file__).resolve().parents[2]
AGENT = str(ROOT / "examples" / "agents" / "math.py")
GOOD = {"prompt": "1 + 1?", "answer": "2"}

# name -> (dataset path under the data folder, split, problem after "<flag> <path>": for RL prompts, for SFT).
# The SFT reader drops rows without a key, so it refuses only a key no row holds (and says so).
ROWS: dict[str, tuple[str, str, str, str | None]] = {
    "missing path": ("nope.jsonl", "train", ": no such file or directory; pass a datasets.save_to_disk", None),
    "rows without the input key": (
        "keys.jsonl",
        "train",
        ": row 0 has no 'prompt' (--data.input_key); keys: ['answer', 'question']",
        ": no row has 'prompt' (--data.input_key); keys of row 0: ['answer', 'question']",
    ),
    "rows without the label key": (
        "nolabel.jsonl",
        "train",
        ": row 0 has no 'answer' (--data.label_key); keys: ['prompt', 'solution']",
        ": no row has 'answer' (--data.output_key); keys of row 0: ['prompt', 'solution']",
    ),
    "a split the folder lacks": (
        "folder",
        "test",
        ": no 'test' split (splits: ['train']); choose one with {split}",
        None,
    ),
    "a split the HF dataset lacks": (
        "hfdict",
        "test",
        ": no 'test' split (splits: ['train']); choose one with {split}",
        None,
    ),
    "an HF dataset without the key": (
        "hfkeys",
        "train",
        ": row 0 has no 'prompt' (--data.input_key); keys: ['answer', 'question']",
        ": no row has 'prompt' (--data.input_key); keys of row 0: ['answer', 'question']",
    ),
    "an empty file": ("empty.jsonl", "train", ": no rows in it; pass a dataset with at least one row", None),
    "a file of blank lines": ("blank.jsonl", "train", ": no rows in it; pass a dataset with at least one row", None),
    "an empty folder": ("emptydir", "train", ": a directory with no dataset in it", None),
    "a malformed first line": ("bad1.jsonl", "train", ":1: not a JSON line (Expecting ',' delimiter)", None),
    "a malformed JSON array": ("bad.json", "train", ":2: not valid JSON (Expecting value)", None),
    "a JSON array of numbers": ("ints.json", "train", ": row 0 must be a JSON object, got int", None),
    "a file that is not parquet": ("bad.parquet", "train", ": cannot read it as parquet", None),
    "a binary file": ("bin.jsonl", "train", ": not UTF-8 text; pass JSON lines", None),
    "a malformed line 4": ("bad4.jsonl", "train", "", None),  # "": passes the start-up check
}
SPLIT_FLAGS = {
    "--data.prompt_dataset": "--data.prompt_split",
    "--data.dataset": "--data.dataset_split",
    "--eval.dataset": "--eval.split",
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")

    def rows(name: str, *rows: dict) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    rows("good.jsonl", GOOD)
    rows("keys.jsonl", {"question": "1 + 1?", "answer": "2"})
    rows("nolabel.jsonl", {"prompt": "1 + 1?", "solution": "2"})
    rows("folder/train.jsonl", GOOD)
    datasets.DatasetDict({"train": datasets.Dataset.from_list([GOOD])}).save_to_disk(str(d / "hfdict"))
    datasets.Dataset.from_list([{"question": "1 + 1?", "answer": "2"}]).save_to_disk(str(d / "hfkeys"))
    (d / "empty.jsonl").write_text("")
    (d / "blank.jsonl").write_text("\n\n")
    (d / "emptydir").mkdir()
    (d / "bad1.jsonl").write_text('{"prompt": "1 + 1?", "answer": "2"\n')
    (d / "bad.json").write_text('[{"prompt": "1 + 1?",\n "answer": }]')
    (d / "ints.json").write_text("[1, 2]")
    (d / "bad.parquet").write_bytes(b"PAR1 not parquet")
    (d / "bin.jsonl").write_bytes(b"\xff\xfe{}\n")
    (d / "bad4.jsonl").write_text((json.dumps(GOOD) + "\n") * 3 + "not json\n")
    return d


def _which(flag: str, path: Path, split: str, d: Path, split_flag: str) -> list[str]:
    """The flags naming ``path``: as the prompts, or as --eval.dataset beside good prompts."""
    if flag == "--eval.dataset":
        main = "--data.dataset" if split_flag == "--data.dataset_split" else "--data.prompt_dataset"
        return [main, str(d / "good.jsonl"), "--eval.dataset", str(path), "--eval.split", split]
    return [flag, str(path), split_flag, split]


def _train_rl(flag: str, path: Path, split: str, d: Path, model: Path) -> list[str]:
    which = _which(flag, path, split, d, "--data.prompt_split")
    keys = ["--data.input_key", "prompt", "--data.label_key", "answer"]
    return [
        "train-rl",
        "--dry-run",
        "--actor.model_name_or_path",
        str(model),
        "--train.agent_path",
        AGENT,
        *which,
        *keys,
    ]


def _trainer(flag: str, path: Path, split: str, d: Path, model: Path) -> list[str]:
    which = _which(flag, path, split, d, "--data.prompt_split")
    keys = ["--data.input_key", "prompt", "--data.label_key", "answer"]
    return ["--dry-run", "--actor.model_name_or_path", str(model), "--envs.urls", "http://127.0.0.1:1", *which, *keys]


def _sft(flag: str, path: Path, split: str, d: Path, model: Path) -> list[str]:
    which = _which(flag, path, split, d, "--data.dataset_split")
    keys = ["--data.input_key", "prompt", "--data.output_key", "answer"]
    return ["train-sft", "--dry-run", "--model.model_name_or_path", str(model), *which, *keys]


def _up(flag: str, path: Path, split: str, d: Path, model: Path) -> list[str]:
    sets = [
        f"data.prompt_dataset={path}",
        f"data.prompt_split={split}",
        "data.input_key=prompt",
        "data.label_key=answer",
    ]
    return ["up", "--run-dir", str(d / "runs" / f"{path.name}-{split}"), "--no-progress", "--set", "trainer", *sets]


def _cli(argv: list[str]) -> int | str | None:
    from molt import cli

    return cli.main(argv)


def _trainer_main(argv: list[str]) -> int | str | None:
    from services.trainer.__main__ import main

    main(argv)
    return 0


# (entry point, the flag it checks, its prog, argv builder, how it runs in this process, RL or SFT rules)
ENTRIES = [
    ("molt up", "--data.prompt_dataset", "molt (the trainer's flags)", _up, _cli, "rl"),
    ("molt train-rl", "--data.prompt_dataset", "molt (the trainer's flags)", _train_rl, _cli, "rl"),
    ("molt train-rl", "--eval.dataset", "molt (the trainer's flags)", _train_rl, _cli, "rl"),
    (
        "python -m services.trainer",
        "--data.prompt_dataset",
        "python -m services.trainer",
        _trainer,
        _trainer_main,
        "rl",
    ),
    ("python -m services.trainer", "--eval.dataset", "python -m services.trainer", _trainer, _trainer_main, "rl"),
    ("molt train-sft", "--data.dataset", "molt train-sft", _sft, _cli, "sft"),
    ("molt train-sft", "--eval.dataset", "molt train-sft", _sft, _cli, "sft"),
]


def _exit(run: Callable[[], int | str | None]) -> int | str | None:
    try:
        return run()
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e[0]} {e[1]}" for e in ENTRIES])
def test_each_bad_dataset_is_one_line_with_status_2_at_each_entry_point(
    entry, row, data, tiny_qwen3, capsys, monkeypatch
):
    name, flag, prog, argv, run, rules = entry
    rel, split, rl_problem, sft_problem = ROWS[row]
    problem = (sft_problem if rules == "sft" and sft_problem else rl_problem).format(split=SPLIT_FLAGS[flag])
    from molt.stack import up

    # Nothing may start: a check that lets a dataset through fails here instead of building a model.
    monkeypatch.setattr(up, "build_model", lambda *_: pytest.fail("molt up went past the dataset check"))
    monkeypatch.setenv("MOLT_TRAINER_DEVICE", "cpu")
    path = data / rel
    args = argv(flag, path, split, data, tiny_qwen3)
    if not problem:  # found only by reading the whole file: the run's own error names the file and line
        if name == "molt up":
            pytest.skip("the check passes it, so molt up would start the stack")
        assert _exit(lambda: run(args)) in (0, None)
        return
    code = _exit(lambda: run(args))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"{prog}: error: {flag} {path}{problem}"), err


@pytest.mark.parametrize(
    "entry,row",
    [
        (ENTRIES[0], "an empty file"),
        (ENTRIES[1], "an HF dataset without the key"),
        (ENTRIES[4], "a file of blank lines"),
        (ENTRIES[5], "rows without the label key"),
    ],
    ids=lambda x: x if isinstance(x, str) else f"{x[0]} {x[1]}",
)
def test_the_shell_sees_status_2_and_one_line(entry, row, data, tiny_qwen3):
    name, flag, prog, argv, _, rules = entry
    rel, split, rl_problem, sft_problem = ROWS[row]
    problem = sft_problem if rules == "sft" and sft_problem else rl_problem
    module = "services.trainer" if name == "python -m services.trainer" else "molt.cli"
    args = argv(flag, data / rel, split, data, tiny_qwen3)
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"{prog}: error: {flag} {data / rel}{problem}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "[molt up]" not in proc.stdout  # no run announced, nothing started


def test_only_the_trainers_rank_0_checks_the_datasets_it_alone_reads(data, tiny_qwen3, monkeypatch, capsys):
    """On several nodes, another rank's file system need not hold the prompts; torchrun stops it when rank 0
    exits with the error."""
    args = _trainer("--data.prompt_dataset", data / "nope.jsonl", "train", data, tiny_qwen3)
    monkeypatch.setenv("RANK", "1")
    assert _exit(lambda: _trainer_main(args)) == 0
    monkeypatch.setenv("RANK", "0")
    assert _exit(lambda: _trainer_main(args)) == 2
    assert "--data.prompt_dataset " in capsys.readouterr().err

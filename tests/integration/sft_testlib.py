"""Shared helpers of the SFT integration tests (no tests here): a reversal task and a CLI runner."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.trainer_testlib import ROOT, env

LETTERS = ["a", "b", "c", "d", "e", "f", "g", "h"]


def reversal_rows(n: int, seed: int) -> list[dict]:
    """'reverse: a c b' -> 'reversed: b c a': a random model cannot do it, a few hundred SFT steps teach it."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        w = [rng.choice(LETTERS) for _ in range(rng.randint(3, 5))]
        out.append({"prompt": "reverse: " + " ".join(w), "response": "reversed: " + " ".join(reversed(w))})
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reversal_flags(model, dataset, *extra: str) -> list[str]:
    """The flags every small SFT run on reversal rows shares: the model, the JSONL's keys, max_len 64, micro-batches
    of 2, no gradient checkpointing; ``extra`` after them."""
    return [
        "--model.model_name_or_path",
        str(model),
        "--data.dataset",
        str(dataset),
        "--data.input_key",
        "prompt",
        "--data.output_key",
        "response",
        "--data.max_len",
        "64",
        "--train.micro_batch_size",
        "2",
        "--model.gradient_checkpoint",
        "none",
        *extra,
    ]


def sft_cmd(nproc: int = 1, molt_cli: bool = False) -> list[str]:
    """``molt_cli``: started as Molt's launch scripts start SFT (``-m molt.cli.train_sft``)."""
    module = ["-m", "molt.cli.train_sft"] if molt_cli else ["-m", "services.trainer.sft"]
    if nproc == 1:
        return [sys.executable, *module]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", f"--nproc_per_node={nproc}", *module]


def run_sft(flags: list[str], nproc: int = 1, molt_cli: bool = False, timeout: float = 180, check: bool = True):
    proc = subprocess.run(
        sft_cmd(nproc, molt_cli) + flags,
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"sft exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def sft_start_up(flags: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """(exit status, stderr) of the SFT CLI's ``main(flags)`` run in this process, for flags that its start-up
    checks settle (a refusal, or ``--dry-run``): they exit before anything loads, so a process would only add
    its imports. Flags that get past them fail the test rather than start a run here."""
    from services.trainer import sft

    monkeypatch.setattr(sft, "init_distributed", lambda: pytest.fail("got past the start-up checks"))
    with pytest.raises(SystemExit) as exc:
        sft.main(flags)
    return exc.value.code or 0, capsys.readouterr().err


def one_error_line(code: int, err: str, text: str) -> None:
    """A flag error as the CLI reports it: status 2, one ``error:`` line holding ``text``, no traceback."""
    assert code == 2, err[-3000:]
    errors = [x for x in err.splitlines() if ": error: " in x]
    assert len(errors) == 1 and text in errors[0], err[-3000:]
    assert "Traceback" not in err


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


COLOURS = {"red": (255, 0, 0), "green": (0, 160, 0), "blue": (0, 0, 255)}


def colour_rows(n: int, seed: int, text_rows: bool = True) -> list[dict]:
    """'<image> colour?' -> the picture's colour; with ``text_rows`` every other row is text-only, so
    length-sorted micro-batches of them carry no image (the blank-image path of several ranks)."""
    from PIL import Image

    rng = random.Random(seed)
    out: list[dict] = []
    for i in range(n):
        if text_rows and i % 2:
            out.append({"prompt": "say hi", "response": "hi", "images": []})
            continue
        name = rng.choice(sorted(COLOURS))
        image = Image.new("RGB", (24, 16), COLOURS[name])
        out.append({"prompt": "<image> colour?", "response": name, "images": [image]})
    return out


def save_colour_data(d: Path, n_train: int, n_eval: int, text_rows: bool = True) -> tuple[Path, Path]:
    """Training rows in the schema Molt's prepare_geo3k.py writes for VLM SFT (a datasets.save_to_disk
    directory: ``prompt`` and ``response`` as message lists, an ``<image>`` literal in the user's text, an image
    column, a ``datasource``), eval rows as JSONL with plain strings naming PNG files."""
    import datasets

    d.mkdir(parents=True, exist_ok=True)
    text = datasets.Value("string")
    message = {"role": text, "content": text}
    features = datasets.Features(
        {
            "datasource": text,
            "prompt": datasets.List(message),
            "response": datasets.List(message),
            "images": datasets.List(datasets.Image()),
        }
    )
    rows = [
        {
            "datasource": "colours",
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "response": [{"role": "assistant", "content": r["response"]}],
            "images": r["images"],
        }
        for r in colour_rows(n_train, seed=1, text_rows=text_rows)
    ]
    datasets.Dataset.from_list(rows, features=features).save_to_disk(str(d / "train"))
    evals = []
    for k, row in enumerate(colour_rows(n_eval, seed=2, text_rows=text_rows)):
        paths = []
        for j, image in enumerate(row["images"]):
            image.save(d / f"eval{k}_{j}.png")
            paths.append(str(d / f"eval{k}_{j}.png"))
        evals.append({**row, "images": paths})
    return d / "train", write_jsonl(d / "eval.jsonl", evals)

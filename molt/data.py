"""Dataset rows as Molt reads them: one reader for RL prompts, eval sets and SFT data.

``read_rows(path)`` accepts what Molt's launch scripts pass: a directory written by
``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``: its ``train`` split unless ``split`` names
another), a parquet / JSONL / JSON file, or a folder of such files (read in name order). Rows come
back as plain dicts in file order; ``max_samples`` stops early without reading the rest.
``read_mixed_rows`` reads several comma-separated datasets, concatenated or mixed by weight.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_SUFFIXES = (".jsonl", ".json", ".parquet")


def read_rows(
    path: str | Path, *, max_samples: int | None = None, split: str = "train", flag: str = "--data.prompt_dataset"
) -> list[dict[str, Any]]:
    """Every row of the dataset at ``path`` (at most ``max_samples``); ``flag`` names the option in errors."""
    rows: list[dict[str, Any]] = []
    for row in iter_rows(path, split=split, flag=flag):
        if max_samples is not None and len(rows) >= max_samples:
            break
        rows.append(row)
    return rows


def iter_rows(path: str | Path, *, split: str = "train", flag: str = "--data.prompt_dataset") -> Iterator[dict]:
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{flag} {p}: no such file or directory")
    if p.is_dir() and _is_saved_dataset(p):
        yield from _saved_dataset(p, split, flag)
        return
    files = sorted(f for f in p.rglob("*") if f.suffix in _SUFFIXES and f.is_file()) if p.is_dir() else [p]
    if not files:
        raise ValueError(
            f"{flag} {p}: a directory with no dataset in it (expected a datasets.save_to_disk "
            f"directory or {', '.join(_SUFFIXES)} files)"
        )
    for f in files:
        yield from _file_rows(f, flag)


def _is_saved_dataset(p: Path) -> bool:
    return (p / "dataset_dict.json").exists() or (p / "state.json").exists()


def _saved_dataset(p: Path, split: str, flag: str) -> Iterator[dict]:
    import datasets  # heavy import: only when a datasets directory is actually read

    loaded = datasets.load_from_disk(str(p))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{flag} {p}: no {split!r} split (splits: {sorted(loaded)})")
        loaded = loaded[split]
    yield from loaded


def _file_rows(f: Path, flag: str) -> Iterator[dict]:
    if f.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(f).iter_batches():
            yield from batch.to_pylist()
        return
    with open(f) as fh:
        if f.suffix == ".json" and fh.read(1) == "[":
            fh.seek(0)
            yield from json.load(fh)
            return
        fh.seek(0)
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag} {f}:{lineno}: not a JSON line ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{flag} {f}:{lineno}: a row must be a JSON object, got {type(row).__name__}")
            yield row


def read_mixed_rows(spec: str, probs: str | None, split: str, max_samples: int, seed: int, flag: str) -> list[dict]:
    """Rows of one or several comma-separated datasets; with ``probs`` (comma-separated weights, one per dataset),
    mixed by weight: each dataset gives its share of ``max_samples`` drawn at random with ``seed`` (Molt's
    blending, --data.prompt_probs / --data.dataset_probs)."""
    paths = [p.strip() for p in spec.split(",") if p.strip()]
    parts = [read_rows(p, split=split, flag=flag) for p in paths]
    if probs is None or len(parts) == 1:
        return [r for part in parts for r in part][:max_samples]
    weights = [float(p) for p in probs.split(",")]
    if len(weights) != len(parts) or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"{flag}: {len(parts)} datasets need as many non-negative sampling weights, got {probs!r}")
    total = sum(weights)
    rng = random.Random(seed)
    out = []
    for part, w in zip(parts, weights):
        want = min(len(part), round(max_samples * w / total))
        out += rng.sample(part, want) if want < len(part) else part
    rng.shuffle(out)
    return out[:max_samples]

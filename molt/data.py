"""Dataset rows as Molt reads them: one reader for RL prompts, eval sets and SFT data.

``read_rows(path)`` accepts what Molt's launch scripts pass: a directory written by
``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``: its ``train`` split unless ``split`` names
another), a parquet / JSONL / JSON file, or a folder of such files (read in name order). Rows come
back as plain dicts in file order; ``max_samples`` stops early without reading the rest.
``read_mixed_rows`` reads several comma-separated datasets, concatenated or mixed by weight.

A folder of files is split as ``datasets.load_dataset(folder)`` splits it, so a folder holding
``train.jsonl`` and ``test.jsonl`` never trains on its test rows: ``data/<split>-NNNNN-of-NNNNN`` shards
name their split; otherwise folders named for a split (train, validation, test and HF's other spellings,
as a whole word of the name) assign every file below them; otherwise file names do. A folder without
split names is one ``train`` split, and any ``split`` asked of it reads all of it, as before.
``check_dataset`` is the cheap start-up check: the path, the split, the first row's keys.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

_SUFFIXES = (".jsonl", ".json", ".parquet")
# datasets.data_files' split keywords and word separators (its SPLIT_KEYWORDS, NON_WORDS_CHARS): a keyword
# counts as a whole word of a file or folder name, so "gsm8k_test.jsonl" is test and "latest.jsonl" is not.
_SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SPLIT_WORD = {
    split: re.compile(rf"(?:^|[-._ 0-9])(?:{'|'.join(words)})(?:[-._ 0-9]|$)")
    for split, words in _SPLIT_KEYWORDS.items()
}
_SHARD = re.compile(r"data/(?P<split>\w+)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*")
# The flag that picks the split of each dataset flag, for the error that lists a folder's splits.
_SPLIT_FLAGS = {"--data.prompt_dataset": "--data.prompt_split", "--data.dataset": "--data.dataset_split"}


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
    for f in split_files(p, split, flag) if p.is_dir() else [p]:
        yield from _file_rows(f, flag)


def split_files(p: Path, split: str, flag: str) -> list[Path]:
    """The data files of folder ``p`` that make up ``split``, in name order (the rule: the module docstring)."""
    files = sorted(f for f in p.rglob("*") if f.suffix in _SUFFIXES and f.is_file())
    if not files:
        raise ValueError(
            f"{flag} {p}: a directory with no dataset in it (expected a datasets.save_to_disk "
            f"directory or {', '.join(_SUFFIXES)} files)"
        )
    splits = _assign_splits(p, files)
    if not splits:
        return files  # no split names: the whole folder is the one split asked for
    if split not in splits:
        _no_split(p, split, list(splits), flag)
    return splits[split]


def _assign_splits(p: Path, files: list[Path]) -> dict[str, list[Path]]:
    """Split name -> files, by the first rule that names any split (as datasets.data_files tries its
    patterns in order); {} when no rule does. A file may fall in several splits, as there."""
    rel = [f.relative_to(p) for f in files]
    shards = [(_SHARD.fullmatch(r.as_posix()), f) for r, f in zip(rel, files)]
    if any(m for m, _ in shards):
        out: dict[str, list[Path]] = {}
        for m, f in shards:
            if m:
                out.setdefault(m["split"], []).append(f)
        return out
    for names in ([r.parts[:-1] for r in rel], [r.parts[-1:] for r in rel]):  # folder names first, then file names
        out = {
            split: [f for f, parts in zip(files, names) if any(word.search(n) for n in parts)]
            for split, word in _SPLIT_WORD.items()
        }
        out = {split: fs for split, fs in out.items() if fs}
        if out:
            return out
    return {}


def _no_split(p: Path, split: str, found: list[str], flag: str) -> NoReturn:
    choose = _SPLIT_FLAGS.get(flag, "--eval.split" if flag == "--eval.dataset" else "the split flag")
    raise ValueError(f"{flag} {p}: no {split!r} split (splits: {sorted(found)}); choose one with {choose}")


def check_dataset(spec: str, split: str, keys: dict[str, str | None], flag: str) -> None:
    """Cheap start-up check of a dataset flag (several comma-separated paths): each path exists, a folder has
    ``split``, and its first row holds every key in ``keys`` (key flag -> key; None: not asked). Reads one row
    of one file (a parquet file's schema); a save_to_disk directory gets its split checked, not its rows.
    Raises the ``ValueError`` reading it would end in, so a run fails before anything starts."""
    for path in (Path(s.strip()) for s in spec.split(",") if s.strip()):
        if not path.exists():
            raise ValueError(f"{flag} {path}: no such file or directory")
        if path.is_dir() and (path / "dataset_dict.json").exists():
            found = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            if split not in found:
                _no_split(path, split, found, flag)
            continue
        if path.is_dir() and _is_saved_dataset(path):
            continue
        first = split_files(path, split, flag)[0] if path.is_dir() else path
        if first.suffix == ".parquet":
            import pyarrow.parquet as pq

            columns = set(pq.read_schema(first).names)
        else:
            row = next(_file_rows(first, flag), None)
            if row is None:
                continue  # no rows to check; reading it says what is wrong with that
            columns = set(row)
        for key_flag, key in keys.items():
            if key is not None and key not in columns:
                raise ValueError(f"{flag} {first}: row 0 has no {key!r} ({key_flag}); keys: {sorted(columns)}")


def _is_saved_dataset(p: Path) -> bool:
    return (p / "dataset_dict.json").exists() or (p / "state.json").exists()


def _saved_dataset(p: Path, split: str, flag: str) -> Iterator[dict]:
    import datasets  # heavy import: only when a datasets directory is actually read

    loaded = datasets.load_from_disk(str(p))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            _no_split(p, split, list(loaded), flag)
        loaded = loaded[split]
    yield from loaded


def _file_rows(f: Path, flag: str) -> Iterator[dict]:
    if f.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(f).iter_batches():
            yield from batch.to_pylist()
        return
    with open(f) as fh:
        if f.suffix == ".json" and _first_char(fh) == "[":  # a JSON array of rows (pretty-printed or not)
            for i, row in enumerate(json.load(fh)):
                if not isinstance(row, dict):
                    raise ValueError(f"{flag} {f}: row {i} must be a JSON object, got {type(row).__name__}")
                yield row
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


def _first_char(fh) -> str:
    """The first character of ``fh`` that is not whitespace ("" for an empty file); rewinds it."""
    while (ch := fh.read(1)) and ch.isspace():
        pass
    fh.seek(0)
    return ch


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

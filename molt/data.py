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
``check_dataset`` is the cheap start-up check: the path, the split, a first row and its keys.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
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
_PROBS_FLAGS = {"--data.prompt_dataset": "--data.prompt_probs", "--data.dataset": "--data.dataset_probs"}


def read_rows(
    path: str | Path, *, max_samples: int | None = None, split: str = "train", flag: str = "--data.prompt_dataset"
) -> list[dict[str, Any]]:
    """Every row of the dataset at ``path`` (at most ``max_samples``); ``flag`` names the option in errors."""
    rows = iter_rows(path, split=split, flag=flag)
    return list(rows if max_samples is None else itertools.islice(rows, max_samples))


def iter_rows(path: str | Path, *, split: str = "train", flag: str = "--data.prompt_dataset") -> Iterator[dict]:
    p = Path(path)
    if not p.exists():
        _no_path(p, flag)
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


def _no_path(p: Path, flag: str) -> NoReturn:
    where = "" if p.is_absolute() else f" (relative to {os.getcwd()})"
    raise ValueError(
        f"{flag} {p}: no such file or directory{where}; pass a datasets.save_to_disk directory, "
        f"a {'/'.join(_SUFFIXES)} file or a folder of them"
    )


def _no_split(p: Path, split: str, found: list[str], flag: str) -> NoReturn:
    choose = _SPLIT_FLAGS.get(flag, "--eval.split" if flag == "--eval.dataset" else "the split flag")
    raise ValueError(f"{flag} {p}: no {split!r} split (splits: {sorted(found)}); choose one with {choose}")


def check_dataset(spec: str, split: str, keys: dict[str, str | None], flag: str, *, every_row: bool = True) -> None:
    """Cheap start-up check of a dataset flag (several comma-separated paths): each path exists, a folder has
    ``split``, the paths hold a row, and the rows hold every key in ``keys`` (key flag -> key; None: not asked).
    ``every_row``: the reader needs each key in every row (RL prompts), so a path's first row is proof; else it
    skips rows without one (SFT), and only a key no row holds is refused, reading on until each has shown up.
    A parquet file gives its schema and row count, a save_to_disk directory its features: neither is loaded.
    Raises the ``ValueError`` reading it would end in, so a run fails before anything starts."""
    wanted = {key_flag: key for key_flag, key in keys.items() if key is not None}
    unseen = {} if every_row else dict(wanted)  # keys no row has shown yet
    first: tuple[Path, set[str]] | None = None
    for path in (Path(s.strip()) for s in spec.split(",") if s.strip()):
        if not path.exists():
            _no_path(path, flag)
        for source, columns in _row_columns(path, split, flag):
            if columns is None:  # a saved dataset without readable features: its rows are not known here
                first, unseen = first or (source, set()), {}
                break
            first = first or (source, columns)
            if every_row:
                _check_keys(source, columns, wanted, flag)
                break
            unseen = {key_flag: key for key_flag, key in unseen.items() if key not in columns}
            if not unseen:
                break
    if first is None:
        # The readers end the same way (no prompts, no usable row), only later: after the model has loaded.
        raise ValueError(f"{flag} {spec}: no rows in it; pass a dataset with at least one row")
    if unseen:
        key_flag, key = next(iter(unseen.items()))
        source, columns = first
        of = "" if str(source) == spec.strip() else f" of {source}"
        raise ValueError(f"{flag} {spec}: no row has {key!r} ({key_flag}); keys of row 0{of}: {sorted(columns)}")


def _check_keys(source: Path, columns: set[str], keys: dict[str, str], flag: str) -> None:
    for key_flag, key in keys.items():
        if key not in columns:
            raise ValueError(f"{flag} {source}: row 0 has no {key!r} ({key_flag}); keys: {sorted(columns)}")


def _row_columns(path: Path, split: str, flag: str) -> Iterator[tuple[Path, set[str] | None]]:
    """(file, its row's keys) for each row of ``path``'s ``split``, lazily, in reading order; a parquet file is
    one item (its schema, when it has rows), a save_to_disk directory one item (its features, None if unknown)."""
    if path.is_dir() and _is_saved_dataset(path):
        yield path, _saved_columns(path, split, flag)
        return
    for f in split_files(path, split, flag) if path.is_dir() else [path]:
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq

            with _parquet_errors(f, flag):
                meta = pq.ParquetFile(f).metadata
            if meta.num_rows:
                yield f, set(meta.schema.to_arrow_schema().names)
            continue
        for row in _file_rows(f, flag):
            yield f, set(row)


def _saved_columns(p: Path, split: str, flag: str) -> set[str] | None:
    """The columns a save_to_disk directory's rows hold (its ``split`` of a DatasetDict), from the JSON files
    ``datasets`` writes beside the data; None where they do not say."""
    if (p / "dataset_dict.json").exists():
        found = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        if split not in found:
            _no_split(p, split, found, flag)
        p = p / split
    try:
        features = json.loads((p / "dataset_info.json").read_text())["features"]
        state = json.loads((p / "state.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(features, dict):
        return None
    shown = state.get("_format_columns") if isinstance(state, dict) else None
    if shown is not None and not state.get("_output_all_columns"):  # set_format(columns=...): rows hold only those
        return set(features) & set(shown)
    return set(features)


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


@contextmanager
def _parquet_errors(f: Path, flag: str) -> Iterator[None]:
    """pyarrow's errors for a file that is not parquet (or cannot be read) as one line naming the flag and the
    file: its own text names neither."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as e:
        why = getattr(e, "strerror", None) or str(e).split(". ")[0]
        raise ValueError(f"{flag} {f}: cannot read it as parquet ({why})") from None


def _file_rows(f: Path, flag: str) -> Iterator[dict]:
    if f.suffix in (".csv", ".arrow"):
        yield from _datasets_file_rows(f, flag)
        return
    if f.suffix == ".parquet":
        import pyarrow.parquet as pq

        with _parquet_errors(f, flag):
            for batch in pq.ParquetFile(f).iter_batches():
                yield from batch.to_pylist()
        return
    try:
        with open(f) as fh:
            if f.suffix == ".json" and _first_char(fh) == "[":  # a JSON array of rows (pretty-printed or not)
                try:
                    rows = json.load(fh)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{flag} {f}:{e.lineno}: not valid JSON ({e.msg})") from None
                for i, row in enumerate(rows):
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
    except UnicodeDecodeError:  # a ValueError whose own text names neither the flag nor the file
        raise ValueError(f"{flag} {f}: not UTF-8 text; pass JSON lines, a JSON array of rows or parquet") from None
    except OSError as e:  # unreadable (permissions, a broken mount): one line, not a traceback
        raise ValueError(f"{flag} {f}: cannot read it ({e.strerror or e})") from None


def _datasets_file_rows(f: Path, flag: str) -> Iterator[dict]:
    """A .csv or a single .arrow file named directly, read by ``datasets`` as Molt's load_dataset reads them (CSV
    types as pandas infers them; .arrow as ``save_to_disk`` writes its shards). Folders still take only the
    JSON/parquet files they hold, as before."""
    import datasets

    try:
        if f.suffix == ".csv":
            loaded = datasets.Dataset.from_csv(str(f), keep_in_memory=True)
        else:
            loaded = datasets.Dataset.from_file(str(f))
    except Exception as e:  # noqa: BLE001  # pandas / pyarrow errors: one line naming the flag and the file
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{flag} {f}: cannot read it as {f.suffix[1:]} ({why})") from None
    assert isinstance(loaded, datasets.Dataset)  # from_csv of one file is one Dataset
    yield from loaded


def _first_char(fh) -> str:
    """The first character of ``fh`` that is not whitespace ("" for an empty file); rewinds it."""
    while (ch := fh.read(1)) and ch.isspace():
        pass
    fh.seek(0)
    return ch


def mix_weights(spec: str, probs: str | None, flag: str) -> list[float] | None:
    """The sampling weights ``probs`` gives the comma-separated datasets of ``spec`` (``flag``); None where nothing
    is mixed (no weights, or one dataset). A ``ValueError`` naming the weights' flag unless there is one finite,
    non-negative number per dataset and they do not all weigh zero: a start-up check, no file is read."""
    count = len([p for p in spec.split(",") if p.strip()])
    if probs is None:
        return None
    try:
        weights = [float(w) for w in probs.split(",")]
    except ValueError:
        weights = []
    if len(weights) != count or not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"{_PROBS_FLAGS.get(flag, 'the weights flag')} {probs!r}: {flag} names {count} datasets; give as many "
            "comma-separated non-negative weights, not all zero (e.g. 0.7,0.3)"
        )
    return weights if count > 1 else None


def read_mixed_rows(spec: str, probs: str | None, split: str, max_samples: int, seed: int, flag: str) -> list[dict]:
    """Rows of one or several comma-separated datasets; with ``probs`` (comma-separated weights, one per dataset),
    mixed by weight: each dataset gives its share of ``max_samples``, or of the rows it takes for every dataset to
    be read whole at those weights when that is fewer, drawn at random with ``seed`` (Molt's blending,
    --data.prompt_probs / --data.dataset_probs)."""
    weights = mix_weights(spec, probs, flag)
    paths = [p.strip() for p in spec.split(",") if p.strip()]
    if weights is None:
        # Concatenated in order, so only the first max_samples rows count: each dataset is read up to what is
        # still wanted (Molt caps each with select(range(...))), never all of a large one. A missing path
        # past the cap is still refused, as when every row was read.
        out: list[dict] = []
        for p in paths:
            if len(out) < max_samples:
                out += read_rows(p, max_samples=max_samples - len(out), split=split, flag=flag)
            elif not Path(p).exists():
                _no_path(Path(p), flag)
        return out
    parts = [read_rows(p, split=split, flag=flag) for p in paths]
    total = sum(weights)
    # Molt interleaves by weight until every dataset has been read whole (stopping_strategy="all_exhausted"): a
    # dataset whose weight outruns its size repeats. Capping each share at the dataset's size instead would let
    # the sizes, not the weights, set the mix whenever --data.max_samples exceeds the rows.
    whole = max((math.ceil(len(part) * total / w) for part, w in zip(parts, weights) if w > 0 and part), default=0)
    n = min(max_samples, whole)
    rng = random.Random(seed)
    out = []
    for part, w in zip(parts, weights):
        want = round(n * w / total)
        if not part:  # an empty dataset gives nothing, whatever its weight
            continue
        if want <= len(part):
            out += rng.sample(part, want) if want < len(part) else part
        else:
            laps, rest = divmod(want, len(part))
            out += part * laps + rng.sample(part, rest)
    rng.shuffle(out)
    return out[:max_samples]

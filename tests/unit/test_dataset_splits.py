"""A folder of data files is split by name, as ``datasets.load_dataset(folder)`` splits it: a run reads only the
split its flag asks for (a folder with train.jsonl and test.jsonl used to train on both), a folder without split
names is read whole, and a split the folder lacks is one line naming the flag and the splits it has."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from datasets.data_files import DataFilesDict, get_data_patterns

from molt.data import check_dataset, read_mixed_rows, read_rows


def write(root: Path, rel: str, *names: str) -> None:
    """A JSONL file at ``root/rel`` with one row per name: {"q": name}."""
    f = root / rel
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("".join(json.dumps({"q": n}) + "\n" for n in names))


def qs(rows: list[dict]) -> list[str]:
    return [r["q"] for r in rows]


def hf_splits(root: Path) -> dict[str, set[str]]:
    """The files of each split as the datasets library assigns them, relative to ``root``."""
    files = DataFilesDict.from_patterns(get_data_patterns(str(root)), base_path=str(root))
    return {split: {Path(f).relative_to(root).as_posix() for f in fs} for split, fs in files.items()}


def test_a_folder_with_train_and_test_files_reads_only_the_asked_split(tmp_path):
    write(tmp_path, "test.jsonl", "t1", "t2")
    write(tmp_path, "train.jsonl", "a", "b", "c")
    assert qs(read_rows(tmp_path)) == ["a", "b", "c"]  # default split train: no test rows
    assert qs(read_rows(tmp_path, split="test")) == ["t1", "t2"]
    assert hf_splits(tmp_path) == {"train": {"train.jsonl"}, "test": {"test.jsonl"}}


def test_split_words_follow_hfs_spellings_and_whole_word_rule(tmp_path):
    # training -> train; dev, val -> validation; eval -> test; "latest" holds "test" inside a word: no split,
    # so it is not read once other files name their splits (as load_dataset leaves it out).
    write(tmp_path, "gsm8k_training-part1.jsonl", "tr1")
    write(tmp_path, "gsm8k_training-part2.jsonl", "tr2")
    write(tmp_path, "my.dev.jsonl", "dev")
    write(tmp_path, "val_2.jsonl", "val")
    write(tmp_path, "eval.jsonl", "ev")
    write(tmp_path, "latest.jsonl", "latest")
    assert qs(read_rows(tmp_path)) == ["tr1", "tr2"]
    assert qs(read_rows(tmp_path, split="validation")) == ["dev", "val"]
    assert qs(read_rows(tmp_path, split="test")) == ["ev"]
    assert hf_splits(tmp_path) == {
        "train": {"gsm8k_training-part1.jsonl", "gsm8k_training-part2.jsonl"},
        "validation": {"my.dev.jsonl", "val_2.jsonl"},
        "test": {"eval.jsonl"},
    }


def test_split_folders_assign_every_file_below_them_before_file_names_count(tmp_path):
    # Folder names win over file names: train/test_ideas.jsonl is train, and top.jsonl (in no split folder)
    # is read by no split.
    write(tmp_path, "train/a/x.jsonl", "x")
    write(tmp_path, "train/test_ideas.jsonl", "ideas")
    write(tmp_path, "gsm8k-valid/v.jsonl", "v")
    write(tmp_path, "test/t.jsonl", "t")
    write(tmp_path, "top.jsonl", "top")
    assert qs(read_rows(tmp_path)) == ["x", "ideas"]
    assert qs(read_rows(tmp_path, split="validation")) == ["v"]
    assert qs(read_rows(tmp_path, split="test")) == ["t"]
    assert hf_splits(tmp_path) == {
        "train": {"train/a/x.jsonl", "train/test_ideas.jsonl"},
        "validation": {"gsm8k-valid/v.jsonl"},
        "test": {"test/t.jsonl"},
    }


def test_hub_shards_name_their_own_splits(tmp_path):
    ds = datasets.Dataset.from_list([{"q": "s0"}, {"q": "s1"}])
    (tmp_path / "data").mkdir()
    ds.select([0]).to_parquet(str(tmp_path / "data" / "train-00000-of-00002.parquet"))
    ds.select([1]).to_parquet(str(tmp_path / "data" / "train-00001-of-00002.parquet"))
    ds.to_parquet(str(tmp_path / "data" / "hard-00000-of-00001.parquet"))
    assert qs(read_rows(tmp_path)) == ["s0", "s1"]
    assert qs(read_rows(tmp_path, split="hard")) == ["s0", "s1"]
    assert set(hf_splits(tmp_path)) == {"train", "hard"}


def test_a_folder_without_split_names_is_read_whole_for_any_split(tmp_path):
    write(tmp_path, "a.jsonl", "a")
    write(tmp_path, "more/b.jsonl", "b")
    assert qs(read_rows(tmp_path)) == qs(read_rows(tmp_path, split="test")) == ["a", "b"]
    assert hf_splits(tmp_path) == {"train": {"a.jsonl", "more/b.jsonl"}}


@pytest.mark.parametrize(
    ("flag", "split_flag"),
    [
        ("--data.prompt_dataset", "--data.prompt_split"),
        ("--data.dataset", "--data.dataset_split"),
        ("--eval.dataset", "--eval.split"),
    ],
)
def test_a_split_the_folder_lacks_is_one_line_naming_the_flags_and_the_splits_found(tmp_path, flag, split_flag):
    write(tmp_path, "train.jsonl", "a")
    write(tmp_path, "test.jsonl", "t")
    with pytest.raises(ValueError) as err:
        read_mixed_rows(str(tmp_path), None, "validation", 10, 0, flag)
    assert str(err.value) == (
        f"{flag} {tmp_path}: no 'validation' split (splits: ['test', 'train']); choose one with {split_flag}"
    )
    with pytest.raises(ValueError, match="no 'validation' split"):
        check_dataset(str(tmp_path), "validation", {}, flag)


def test_a_saved_dataset_dict_still_reads_its_split_and_is_checked_without_loading(tmp_path):
    splits = {"train": [{"q": "a"}], "test": [{"q": "t"}]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(tmp_path))
    assert qs(read_rows(tmp_path)) == ["a"] and qs(read_rows(tmp_path, split="test")) == ["t"]
    check_dataset(str(tmp_path), "test", {"--data.input_key": "q"}, "--data.prompt_dataset")
    with pytest.raises(ValueError, match=r"no 'dev' split \(splits: \['test', 'train'\]\)"):
        check_dataset(str(tmp_path), "dev", {}, "--data.prompt_dataset")


def test_the_start_up_check_reads_one_row_of_the_split_it_will_train_on(tmp_path):
    keys = {"--data.input_key": "q", "--data.label_key": None}
    with pytest.raises(ValueError, match="^--data.prompt_dataset .*nope.jsonl: no such file or directory; pass "):
        check_dataset(f"{tmp_path / 'nope.jsonl'}", "train", keys, "--data.prompt_dataset")
    write(tmp_path, "d/train.jsonl", "a")
    (tmp_path / "d" / "test.jsonl").write_text('{"other": 1}\n')  # not the train split: never looked at
    check_dataset(str(tmp_path / "d"), "train", keys, "--data.prompt_dataset")
    with pytest.raises(ValueError) as err:
        check_dataset(str(tmp_path / "d"), "test", keys, "--data.prompt_dataset")
    assert str(err.value) == (
        f"--data.prompt_dataset {tmp_path / 'd' / 'test.jsonl'}: row 0 has no 'q' (--data.input_key); keys: ['other']"
    )
    datasets.Dataset.from_list([{"q": "a"}]).to_parquet(str(tmp_path / "p.parquet"))
    both = f"{tmp_path / 'd'},{tmp_path / 'p.parquet'}"  # comma-separated: each one is checked
    check_dataset(both, "train", keys, "--data.prompt_dataset")
    with pytest.raises(ValueError, match=r"p.parquet: row 0 has no 'label' \(--data.label_key\); keys: \['q'\]"):
        check_dataset(
            str(tmp_path / "p.parquet"), "train", {**keys, "--data.label_key": "label"}, "--data.prompt_dataset"
        )
    with pytest.raises(ValueError, match="nope.jsonl: no such file"):
        check_dataset(f"{both},{tmp_path / 'nope.jsonl'}", "train", keys, "--data.prompt_dataset")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl: no rows in it"):  # the reader would refuse it after the model
        check_dataset(str(tmp_path / "empty.jsonl"), "train", keys, "--data.prompt_dataset")
    check_dataset(f"{tmp_path / 'empty.jsonl'},{both}", "train", keys, "--data.prompt_dataset")  # one holds rows

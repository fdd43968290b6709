"""``molt.data.check_dataset``, the start-up check every entry point runs on its dataset flags: what reading the
dataset would refuse after the model has loaded (an empty dataset, a key no row holds, a file that is not JSON
or parquet) is refused before, in one line naming the flag and the file; what reading accepts, it accepts."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from molt import data
from molt.data import check_dataset, read_rows

RL_KEYS = {"--data.input_key": "prompt", "--data.label_key": "answer"}
SFT_KEYS = {"--data.input_key": "prompt", "--data.output_key": "answer"}
FLAG = "--data.prompt_dataset"


def jsonl(path: Path, *rows: dict) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_missing_path_names_the_forms_accepted_and_where_a_relative_one_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        check_dataset("data/nope.jsonl", "train", RL_KEYS, FLAG)
    assert str(err.value) == (
        f"{FLAG} data/nope.jsonl: no such file or directory (relative to {tmp_path}); pass a datasets.save_to_disk "
        "directory, a .jsonl/.json/.parquet file or a folder of them"
    )
    with pytest.raises(ValueError, match=r"^--eval.dataset /nope.jsonl: no such file or directory; pass "):
        read_rows("/nope.jsonl", flag="--eval.dataset")


def test_a_dataset_without_rows_is_refused_unless_another_path_of_the_flag_has_some(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "empty.json").write_text("[]")
    datasets.Dataset.from_list([{"prompt": "a", "answer": "b"}]).select([]).to_parquet(str(tmp_path / "e.parquet"))
    for name in ("empty.jsonl", "blank.jsonl", "empty.json", "e.parquet"):
        with pytest.raises(ValueError) as err:
            check_dataset(str(tmp_path / name), "train", RL_KEYS, FLAG)
        assert str(err.value) == f"{FLAG} {tmp_path / name}: no rows in it; pass a dataset with at least one row"
    good = jsonl(tmp_path / "good.jsonl", {"prompt": "p", "answer": "a"})
    check_dataset(f"{tmp_path / 'empty.jsonl'},{good}", "train", RL_KEYS, FLAG)  # read together: rows to train on
    both_empty = f"{tmp_path / 'empty.jsonl'},{tmp_path / 'blank.jsonl'}"
    with pytest.raises(ValueError, match=f"^{FLAG} {both_empty}: no rows in it"):
        check_dataset(both_empty, "train", RL_KEYS, FLAG)


def test_the_first_row_checked_is_the_first_row_read_past_empty_files(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("\n")
    jsonl(tmp_path / "d" / "b.jsonl", {"question": "p"})
    with pytest.raises(ValueError) as err:
        check_dataset(str(tmp_path / "d"), "train", RL_KEYS, FLAG)
    assert str(err.value) == (
        f"{FLAG} {tmp_path / 'd' / 'b.jsonl'}: row 0 has no 'prompt' (--data.input_key); keys: ['question']"
    )


def test_rl_prompts_need_each_key_in_row_0_sft_rows_only_in_some_row(tmp_path):
    """RL's reader refuses any row without --data.input_key; SFT's drops and counts it, so only a key no row
    holds (a misspelt flag) would end in its 'no usable row'."""
    path = jsonl(tmp_path / "p.jsonl", {"prompt": "p"}, {"prompt": "p", "answer": "a"})
    with pytest.raises(ValueError, match=r"p.jsonl: row 0 has no 'answer' \(--data.label_key\); keys: \['prompt'\]"):
        check_dataset(path, "train", RL_KEYS, FLAG)
    check_dataset(path, "train", SFT_KEYS, "--data.dataset", every_row=False)
    with pytest.raises(ValueError) as err:
        check_dataset(path, "train", {**SFT_KEYS, "--data.output_key": "response"}, "--data.dataset", every_row=False)
    assert str(err.value) == (
        f"--data.dataset {path}: no row has 'response' (--data.output_key); keys of row 0: ['prompt']"
    )
    other = jsonl(tmp_path / "o.jsonl", {"prompt": "p", "response": "r"})  # several paths: any of them may hold it
    check_dataset(f"{path},{other}", "train", {"--data.output_key": "response"}, "--data.dataset", every_row=False)
    with pytest.raises(ValueError, match=rf"no row has 'x' \(--data.input_key\); keys of row 0 of {path}: "):
        check_dataset(f"{path},{other}", "train", {"--data.input_key": "x"}, "--data.dataset", every_row=False)


def test_a_saved_dataset_is_checked_from_its_features_without_loading_it(tmp_path, monkeypatch):
    rows = [{"prompt": "p", "answer": "a", "extra": 1}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    splits = {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list([{"q": "t"}])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
    shown = datasets.Dataset.from_list(rows)
    shown.set_format(columns=["prompt"])  # its rows hold only 'prompt', as the reader sees them
    shown.save_to_disk(str(tmp_path / "shown"))
    monkeypatch.setattr(datasets, "load_from_disk", lambda *_: pytest.fail("the check loaded the dataset"))
    check_dataset(str(tmp_path / "hf"), "train", RL_KEYS, FLAG)
    check_dataset(str(tmp_path / "dict"), "train", RL_KEYS, FLAG)
    with pytest.raises(ValueError) as err:
        check_dataset(str(tmp_path / "dict"), "test", RL_KEYS, FLAG)
    assert str(err.value) == f"{FLAG} {tmp_path / 'dict'}: row 0 has no 'prompt' (--data.input_key); keys: ['q']"
    with pytest.raises(ValueError, match=r"row 0 has no 'answer' \(--data.label_key\); keys: \['prompt'\]"):
        check_dataset(str(tmp_path / "shown"), "train", RL_KEYS, FLAG)
    with pytest.raises(ValueError, match=r"hf: no row has 'response' \(--data.output_key\)"):
        check_dataset(
            str(tmp_path / "hf"), "train", {"--data.output_key": "response"}, "--data.dataset", every_row=False
        )
    (tmp_path / "hf" / "dataset_info.json").write_text("{}")  # features unknown: left to the reader
    check_dataset(str(tmp_path / "hf"), "train", {"--data.output_key": "response"}, "--data.dataset", every_row=False)


@pytest.mark.parametrize(
    "name,content,problem",
    [
        ("bad.jsonl", '\n{"prompt": "p", "answer": }\n', "bad.jsonl:2: not a JSON line (Expecting value)"),
        ("bad.json", '[{"prompt": "p",\n "answer": }]', "bad.json:2: not valid JSON (Expecting value)"),
        ("ints.json", "[1, 2]", "ints.json: row 0 must be a JSON object, got int"),
        ("list.jsonl", "[1]\n", "list.jsonl:1: a row must be a JSON object, got list"),
        ("bin.jsonl", b"\xff\xfe{}\n", "bin.jsonl: not UTF-8 text; pass JSON lines, a JSON array of rows or parquet"),
        ("bad.parquet", b"PAR1 not parquet", "bad.parquet: cannot read it as parquet (Parquet magic bytes not found"),
    ],
)
def test_a_file_that_cannot_be_read_as_rows_is_one_line_naming_the_flag_and_the_file(tmp_path, name, content, problem):
    f = tmp_path / name
    f.write_bytes(content) if isinstance(content, bytes) else f.write_text(content)
    for read in (lambda: check_dataset(str(f), "train", RL_KEYS, FLAG), lambda: read_rows(f)):
        with pytest.raises(ValueError) as err:
            read()
        assert str(err.value).startswith(f"{FLAG} {tmp_path / problem}"), str(err.value)


def test_a_bad_line_deep_in_a_file_passes_the_check_and_reading_it_names_the_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "p", "answer": "a"}\n' * 3 + "not json\n")
    check_dataset(str(path), "train", RL_KEYS, FLAG)  # reads one row: a huge file costs nothing here
    with pytest.raises(ValueError, match=f"^{FLAG} {path}:4: not a JSON line"):
        read_rows(path)


def test_an_unreadable_file_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    path = jsonl(tmp_path / "p.jsonl", {"prompt": "p", "answer": "a"})

    def refuse(*_args, **_kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(data, "open", refuse, raising=False)  # root reads any file: chmod cannot stand in
    with pytest.raises(ValueError) as err:
        check_dataset(path, "train", RL_KEYS, FLAG)
    assert str(err.value) == f"{FLAG} {path}: cannot read it (Permission denied)"


def test_the_trainer_checks_its_datasets_apart_from_its_flag_rules(tmp_path):
    """validate_settings also checks Helm values, whose paths name files in the cluster: it reads none."""
    from molt.config import parse_settings
    from services.trainer.checks import check_datasets, validate_settings
    from services.trainer.config import TrainerSettings

    base = ["--actor.model_name_or_path", "m", "--envs.urls", "http://e:1", "--data.input_key", "prompt"]
    s = parse_settings(TrainerSettings, [*base, "--data.prompt_dataset", "/cluster/prompts.jsonl"], environ={})
    validate_settings(s)
    with pytest.raises(ValueError, match="^--data.prompt_dataset /cluster/prompts.jsonl: no such file"):
        check_datasets(s)
    s.train.dispatch = False  # the prompts are never read: nothing to check
    check_datasets(s)
    good = jsonl(tmp_path / "p.jsonl", {"prompt": "p"})
    flags = [*base, "--data.prompt_dataset", good, "--eval.dataset", str(tmp_path / "empty.jsonl")]
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="^--eval.dataset .*empty.jsonl: no rows in it"):
        check_datasets(parse_settings(TrainerSettings, flags, environ={}))


def test_sft_checks_both_datasets_with_its_own_keys(tmp_path):
    from molt.config import parse_settings
    from services.trainer.sft_checks import check_datasets
    from services.trainer.sft_config import SftSettings

    train = jsonl(tmp_path / "t.jsonl", {"messages": []}, {"prompt": "p", "response": "r"})
    flags = ["--model.model_name_or_path", "m", "--data.dataset", train, "--data.input_key", "prompt"]
    check_datasets(parse_settings(SftSettings, [*flags, "--data.output_key", "response"], environ={}))
    with pytest.raises(ValueError, match=r"^--data.dataset .*: no row has 'answer' \(--data.output_key\)"):
        check_datasets(parse_settings(SftSettings, [*flags, "--data.output_key", "answer"], environ={}))
    with pytest.raises(ValueError, match=r"^--eval.dataset .*nope.jsonl: no such file"):
        check_datasets(
            parse_settings(SftSettings, [*flags, "--eval.dataset", str(tmp_path / "nope.jsonl")], environ={})
        )


@pytest.mark.parametrize("probs", ["0.5,x", "0.5", "0.2,0.3,0.5", "0,0", "-1,2", "nan,1", "inf,1", ""])
@pytest.mark.parametrize(
    ("entry", "dataset_flag", "probs_flag"),
    [("rl", "--data.prompt_dataset", "--data.prompt_probs"), ("sft", "--data.dataset", "--data.dataset_probs")],
)
def test_mixing_weights_that_do_not_fit_the_datasets_are_refused_naming_their_flag(
    tmp_path, entry, dataset_flag, probs_flag, probs
):
    """--data.prompt_probs / --data.dataset_probs: one finite, non-negative weight per dataset, not all zero, checked
    with the other flags (--dry-run too) instead of a bare float error once the datasets are read."""
    from molt.config import parse_settings
    from services.trainer.checks import validate_settings
    from services.trainer.config import TrainerSettings
    from services.trainer.sft_config import SftSettings, validate_sft

    spec = f"{jsonl(tmp_path / 'a.jsonl', {'prompt': 'a'})},{jsonl(tmp_path / 'b.jsonl', {'prompt': 'b'})}"
    if entry == "rl":
        flags = [dataset_flag, spec, f"{probs_flag}={probs}", "--model.path", str(tmp_path)]
        flags += ["--rollout.urls", "http://127.0.0.1:1", "--envs.urls", "http://127.0.0.1:1"]
        settings, validate = parse_settings(TrainerSettings, flags, prog="t"), validate_settings
    else:
        flags = [dataset_flag, spec, f"{probs_flag}={probs}", "--model.model_name_or_path", str(tmp_path)]
        settings, validate = parse_settings(SftSettings, flags, prog="t"), validate_sft
    with pytest.raises(ValueError, match=rf"^{probs_flag} '{probs}': {dataset_flag} names 2 datasets; give as many"):
        validate(settings)
    good = parse_settings(type(settings), [*flags, f"{probs_flag}=0.7,0.3"], prog="t")
    validate(good)  # type: ignore[arg-type]


def test_mixed_rows_follow_the_weights_and_one_dataset_needs_none(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", *({"prompt": f"a{i}"} for i in range(30)))
    b = jsonl(tmp_path / "b.jsonl", *({"prompt": f"b{i}"} for i in range(30)))
    rows = data.read_mixed_rows(f"{a},{b}", "3,1", "train", 20, 0, FLAG)
    assert sorted(r["prompt"][0] for r in rows) == ["a"] * 15 + ["b"] * 5
    assert data.mix_weights(a, "1", FLAG) is None

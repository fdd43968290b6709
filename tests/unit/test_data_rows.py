"""molt.data.read_rows: the formats Molt's launch scripts pass, read to the same rows."""

import json

import datasets
import pytest

from molt.data import read_rows

ROWS = [{"prompt": f"q{i}", "label": str(i)} for i in range(5)]


def test_every_format_reads_to_the_same_rows(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "hfdict"))
    (tmp_path / "pq").mkdir()
    ds.select(range(3)).to_parquet(str(tmp_path / "pq" / "a.parquet"))
    ds.select(range(3, 5)).to_parquet(str(tmp_path / "pq" / "b.parquet"))
    (tmp_path / "arr.json").write_text(json.dumps(ROWS))
    (tmp_path / "pretty.json").write_text("\n  " + json.dumps(ROWS, indent=2))  # an editor's leading blank line
    for path in ("p.jsonl", "hf", "hfdict", "pq", "arr.json", "pretty.json"):
        assert read_rows(tmp_path / path) == ROWS, path


def test_max_samples_stops_early(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    assert read_rows(tmp_path / "p.jsonl", max_samples=2) == ROWS[:2]


def test_bad_inputs_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--eval.dataset .*no such file"):
        read_rows(tmp_path / "missing", flag="--eval.dataset")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no dataset in it"):
        read_rows(tmp_path / "empty")
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON line"):
        read_rows(tmp_path / "bad.jsonl")
    (tmp_path / "nested.json").write_text('[{"a": 1}, [2]]')
    with pytest.raises(ValueError, match="nested.json: row 1 must be a JSON object, got list"):
        read_rows(tmp_path / "nested.json")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match="no 'train' split"):
        read_rows(tmp_path / "d")


def test_prompt_dataset_reads_a_saved_dataset_with_molts_keys(tmp_path):
    from services.trainer.dispatch import PromptDataset

    tools = [{"type": "function", "function": {"name": "python_executor", "parameters": {}}}]
    rows = [
        {"question": f"q{i}", "reward_model": {"ground_truth": str(i)}, "tools": json.dumps(tools) if i else None}
        for i in range(4)
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    ds = PromptDataset(
        str(tmp_path / "hf"), "question", "reward_model", chat=True, max_samples=3, seed=0, tools_key="tools"
    )
    assert len(ds) == 3  # --data.max_samples
    by_text = {p.prompt[0]["content"]: p for p in (ds.get(i) for i in range(3))}
    assert by_text["q1"].prompt == [{"role": "user", "content": "q1"}]  # --data.apply_chat_template
    assert by_text["q1"].label == {"ground_truth": "1"} and by_text["q1"].tools == tools
    assert by_text["q0"].tools is None
    with pytest.raises(ValueError, match="--data.prompt_dataset .*row 0 has no 'input'"):
        PromptDataset(str(tmp_path / "hf"), "input", None, chat=False, max_samples=9, seed=0)


def test_prompt_dataset_walks_every_row_once_per_episode_in_a_seeded_order(tmp_path):
    from services.trainer.dispatch import PromptDataset

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"input": f"p{i}"}) + "\n" for i in range(5)))
    ds = PromptDataset(str(path), "input", None, chat=False, max_samples=9, seed=3)
    first, second = [ds.row(p) for p in range(5)], [ds.row(p) for p in range(5, 10)]
    assert sorted(first) == sorted(second) == [0, 1, 2, 3, 4]
    assert first != list(range(5))  # shuffled: position p is not row p (readers of a run must map it)
    assert [ds.get(p).prompt for p in range(10)] == [f"p{r}" for r in first + second]
    again = PromptDataset(str(path), "input", None, chat=False, max_samples=9, seed=3)
    assert [again.row(p) for p in reversed(range(10))] == list(reversed(first + second))


def test_prompt_datasets_mix_by_molts_prompt_probs_and_split(tmp_path):
    """--data.prompt_dataset a,b --data.prompt_probs 3,1 --data.prompt_split test: each dataset gives its share of
    --data.max_samples, drawn with the seed; a DatasetDict is read at the named split."""
    from molt.config import parse_settings
    from services.trainer.config import TrainerSettings
    from services.trainer.dispatch import PromptDataset

    a = datasets.Dataset.from_list([{"input": f"a{i}"} for i in range(40)])
    datasets.DatasetDict({"test": a}).save_to_disk(str(tmp_path / "a"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list([{"input": f"b{i}"} for i in range(40)])}).save_to_disk(
        str(tmp_path / "b")
    )
    s = parse_settings(
        TrainerSettings,
        ["--data.prompt_dataset", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--data.prompt_probs", "3,1"]
        + ["--data.prompt_split", "test", "--data.max_samples", "20", "--actor.model_name_or_path", "m"],
        environ={},
    )
    d = s.data
    assert d.prompt_dataset is not None

    def build():
        return PromptDataset(
            d.prompt_dataset,
            "input",
            None,
            chat=False,
            max_samples=20,
            seed=1,
            split=d.prompt_split,
            probs=d.prompt_probs,
        )

    ds = build()
    prompts = [ds.get(p).prompt for p in range(20)]
    assert sum(p.startswith("a") for p in prompts) == 15 and sum(p.startswith("b") for p in prompts) == 5
    assert [build().get(p).prompt for p in range(20)] == prompts  # the same mix after a restart
    with pytest.raises(ValueError, match="--data.prompt_probs .1.: --data.prompt_dataset names 2 datasets"):
        PromptDataset(d.prompt_dataset, "input", None, chat=False, max_samples=20, seed=1, split="test", probs="1")


def test_prompt_rows_molt_refuses_are_refused_naming_the_flag(tmp_path):
    """As Molt: chat messages need --data.apply_chat_template (else they would reach the model untemplated),
    and a --data.label_key a row lacks is an error, not an empty label every reward then scores against."""
    from services.trainer.dispatch import PromptDataset

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"input": [{"role": "user", "content": "hi"}], "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="row 0's 'input' holds chat messages: pass --data.apply_chat_template"):
        PromptDataset(str(chat), "input", "answer", chat=False, max_samples=9, seed=0)
    assert PromptDataset(str(chat), "input", "answer", chat=True, max_samples=9, seed=0).get(0).label == "1"
    with pytest.raises(ValueError, match=r"row 0 has no 'label' \(--data.label_key\)"):
        PromptDataset(str(chat), "input", "label", chat=True, max_samples=9, seed=0)


def test_the_eval_set_is_read_whole_whatever_data_max_samples(tmp_path):
    """As Molt: --data.max_samples caps the training prompts; evaluation keeps every eval row."""
    from molt.config import parse_settings
    from services.trainer.config import TrainerSettings
    from services.trainer.evaluate import Evaluator

    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"input": f"q{i}"}) + "\n" for i in range(10)))
    flags = ["--actor.model_name_or_path", "m", "--eval.dataset", str(path), "--data.max_samples", "4"]
    assert len(Evaluator(parse_settings(TrainerSettings, flags, environ={}), dispatcher=None).dataset) == 10


def test_a_label_column_without_label_key_is_warned_about(tmp_path, caplog):
    """Every label would be "" and a reward that checks it would score 0 with no hint why."""
    from services.trainer.dispatch import PromptDataset

    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    ds = PromptDataset(str(path), "question", None, chat=False, max_samples=9, seed=0)
    assert ds.rows[0].label == "" and "'answer' column but no --data.label_key" in caplog.text
    caplog.clear()
    PromptDataset(str(path), "question", "answer", chat=False, max_samples=9, seed=0)
    assert "label_key" not in caplog.text


def test_max_samples_caps_each_dataset_while_reading(tmp_path):
    """Without weights the datasets concatenate and only the first max_samples rows count: each is read only up
    to what is still wanted (a bad row past them is never reached), and the rows are those of reading it all."""
    from molt.data import read_mixed_rows

    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "not json\n")
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({**r, "prompt": "b" + r["prompt"]}) + "\n" for r in ROWS) + "not json\n")
    assert read_mixed_rows(str(a), None, "train", 3, 0, "--data.dataset") == ROWS[:3]
    both = read_mixed_rows(f"{a},{b}", None, "train", 5, 0, "--data.dataset")
    assert both == ROWS
    datasets.Dataset.from_list(ROWS * 20).save_to_disk(str(tmp_path / "hf"))
    assert read_mixed_rows(f"{tmp_path / 'hf'},{b}", None, "train", 7, 0, "--data.dataset") == (ROWS * 2)[:7]
    with pytest.raises(ValueError, match="not a JSON line"):  # past the cap of the first, the second is read
        read_mixed_rows(f"{a},{b}", None, "train", 20, 0, "--data.dataset")


def test_a_csv_or_an_arrow_file_is_read_by_datasets(tmp_path):
    """As Molt's load_dataset: a .csv (types as pandas infers) and a single .arrow file of save_to_disk."""
    rows = [{"prompt": f"q{i}", "n": i} for i in range(3)]
    (tmp_path / "p.csv").write_text("prompt,n\n" + "".join(f"q{i},{i}\n" for i in range(3)))
    assert read_rows(tmp_path / "p.csv") == rows
    assert read_rows(tmp_path / "p.csv", max_samples=2) == rows[:2]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    (arrow,) = (tmp_path / "hf").glob("*.arrow")
    assert read_rows(arrow) == rows
    (tmp_path / "bad.arrow").write_text("not arrow")
    with pytest.raises(ValueError, match=r"^--data.dataset .*bad.arrow: cannot read it as arrow \("):
        read_rows(tmp_path / "bad.arrow", flag="--data.dataset")

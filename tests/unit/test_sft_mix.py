"""--data.dataset_probs (and the RL trainer's --data.prompt_probs): the weights set the mix even when
--data.max_samples exceeds the rows, as Molt's interleave until every dataset is read whole sets it."""

import json

from molt.data import read_mixed_rows


def _spec(tmp_path, sizes):
    for name, n in sizes.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"src": name, "i": i}) + "\n" for i in range(n)))
    return ",".join(str(tmp_path / f"{name}.jsonl") for name in sizes)


def test_weights_hold_when_max_samples_exceeds_the_rows(tmp_path):
    spec = _spec(tmp_path, {"a": 100, "b": 100})
    rows = read_mixed_rows(spec, "0.9,0.1", "train", 1_000_000, 0, "--data.dataset")
    # every row of b once; a, nine times as often, read nine times over
    assert len(rows) == 1000 and sum(r["src"] == "a" for r in rows) == 900
    assert {(r["src"], r["i"]) for r in rows} == {(s, i) for s in "ab" for i in range(100)}
    assert read_mixed_rows(spec, "0.9,0.1", "train", 1_000_000, 0, "--data.dataset") == rows  # seeded


def test_a_cap_below_the_rows_takes_each_share_without_repeats(tmp_path):
    spec = _spec(tmp_path, {"a": 100, "b": 100})
    rows = read_mixed_rows(spec, "3,1", "train", 80, 0, "--data.dataset")
    assert len(rows) == 80 and sum(r["src"] == "a" for r in rows) == 60
    assert len({(r["src"], r["i"]) for r in rows}) == 80
    assert [r["src"] for r in read_mixed_rows(spec, "1,0", "train", 1_000_000, 0, "--data.dataset")] == ["a"] * 100


def test_an_empty_dataset_gives_nothing(tmp_path):
    spec = _spec(tmp_path, {"a": 10, "b": 0})
    rows = read_mixed_rows(spec, "1,1", "train", 1_000_000, 0, "--data.dataset")
    assert [r["src"] for r in rows] == ["a"] * 10

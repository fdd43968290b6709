"""pytest imports test modules by basename (tests/ dirs are not packages): two files of one name break collection."""

import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename():
    names = collections.Counter(p.name for p in ROOT.rglob("test_*.py") if "fixtures" not in p.parts)
    assert [n for n, c in names.items() if c > 1] == []

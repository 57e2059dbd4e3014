"""pytest imports test modules by basename (the test folders are not packages):
two test files of one name anywhere under ``tests/`` stop the whole run at
collection, so each basename is used once."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_name_is_used_once():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []

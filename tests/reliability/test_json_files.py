"""JSON that dspark did not write in this process goes through one parser (dspark.files.parse_json / read_json):
whatever the bytes, the result is the value or one DSparkError line naming where the JSON came from (issue 42,
re-audit). Before, each reader caught its own subset: a 5000-digit integer or deep nesting in a prompt file, a
damaged cache entry, or a draft vocabulary file ended in the generic internal-error line."""
import json
import re
from pathlib import Path

import pytest

from dspark.errors import DSparkError
from dspark.files import parse_json, read_json

DEEP = "[" * 100_000 + "]" * 100_000

BAD = {
    "malformed": ("{", "is not valid JSON"),
    "cut short": ('{"prompt": "w1', "is not valid JSON"),
    "not UTF-8": (b'{"a": "\xff"}', "is not UTF-8 text (byte 7)"),
    "nested too deeply": (DEEP, "nested too deeply"),
    "NaN": ('{"x": NaN}', "NaN is not a JSON number"),
    "-Infinity": ("[-Infinity]", "-Infinity is not a JSON number"),
    "a number too large to be finite": ('{"x": 1e999}', "the number 1e999 is too large"),
    "an integer of 5000 digits": ("7" * 5000, "an integer of more than 4300 digits"),
    "empty": ("", "is not valid JSON"),
    "not text at all": (None, "is not JSON text (NoneType)"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_json_is_one_line_naming_its_source(name):
    text, says = BAD[name]
    with pytest.raises(DSparkError) as refused:
        parse_json(text, "the-label.json")
    message = str(refused.value)
    assert message.startswith("the-label.json ") and says in message and "\n" not in message, message
    assert len(message) < 400


@pytest.mark.parametrize("text, kind, says", [("[1]", dict, "must hold a JSON object, not array"),
                                              ('{"a": 1}', list, "must hold a JSON array, not object"),
                                              ("null", dict, "must hold a JSON object, not null"),
                                              ('"x"', (dict, list), "object or array, not string")])
def test_the_top_level_kind_is_checked_where_asked(text, kind, says):
    with pytest.raises(DSparkError, match=re.escape(says)):
        parse_json(text, "x.json", kind)


def test_good_json_reads_as_before_and_a_bom_is_allowed(tmp_path):
    doc = {"a": [1, 2.5, None, True, "é"], "big": 10 ** 300, "small": 1e-300}
    assert parse_json(json.dumps(doc), "x") == doc
    path = tmp_path / "with-bom.json"
    path.write_bytes("\ufeff".encode() + json.dumps(doc).encode())
    assert read_json(path, kind=dict) == doc


def test_read_json_names_a_missing_or_unreadable_file(tmp_path):
    with pytest.raises(DSparkError, match="cannot read .*nope.json"):
        read_json(tmp_path / "nope.json")
    with pytest.raises(DSparkError, match="cannot read .*Is a directory"):
        read_json(tmp_path)


def test_dspark_parses_outside_json_only_through_files_py():
    """Every json.load/json.loads of the package is in dspark/files.py (anything else would need its own catch-all)."""
    root = Path(__file__).resolve().parents[2] / "dspark"
    found = [f"{path.relative_to(root)}:{i}" for path in sorted(root.rglob("*.py")) if path.name != "files.py"
             or path.parent != root
             for i, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\bjson\.loads?\(", line)]
    assert found == []


def test_a_damaged_verified_files_cache_is_hashed_again(bundle, tmp_path, monkeypatch):
    from dspark.runtime import Runtime

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("DSPARK_CACHE", str(cache))
    for damage in (DEEP, "7" * 5000, "[]", "\xff"):
        (cache / "verified-files.json").write_text(damage)
        Runtime(bundle, threads=1).close()
        assert isinstance(json.loads((cache / "verified-files.json").read_text()), dict)  # rewritten whole


def test_a_damaged_sps_cache_entry_is_profiled_again(bundle, tmp_path, monkeypatch):
    from dspark.calibration import sps_cache
    from dspark.runtime import Runtime

    monkeypatch.setattr(sps_cache, "cache_dir", lambda: tmp_path / "cache")
    with Runtime(bundle, threads=1) as rt:
        path = sps_cache.entry_path(rt)
        path.parent.mkdir(parents=True)
        for damage in (DEEP, '{"sps_table": [1e999]}', "7" * 5000):
            path.write_text(damage)
            assert sps_cache.load(rt) is None


@pytest.mark.parametrize("damage", [DEEP, '{"format": 1, "vocab_size": 6, "ranked_ids": [' + "9" * 5000 + "]}",
                                    '{"format": "dspark-draft-vocab", "vocab_size": 6, "ranked_ids": "012"}'])
def test_a_damaged_draft_vocabulary_file_is_one_line(tmp_path, damage):
    from dspark.models.draft_vocab import FILE, read_ranking

    (tmp_path / FILE).write_text(damage)
    with pytest.raises(DSparkError) as refused:
        read_ranking(tmp_path, 6)
    assert str(tmp_path / FILE) in str(refused.value)

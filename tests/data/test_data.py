"""The packaged corpora and `read_texts` (`quantobs.data`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantobs.data import calibration_texts, heldout_texts, read_texts


def test_the_corpora_load_with_their_sizes() -> None:
    calibration, heldout = calibration_texts(), heldout_texts()
    assert len(calibration) == 200
    assert len(heldout) == 100
    for texts in (calibration, heldout):
        assert all(text == text.strip() and text for text in texts)


def test_the_corpora_hold_no_duplicates_and_do_not_overlap() -> None:
    calibration, heldout = calibration_texts(), heldout_texts()
    assert len(set(calibration)) == len(calibration)
    assert len(set(heldout)) == len(heldout)
    assert not set(calibration) & set(heldout)


def test_read_texts_txt_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "texts.txt"
    path.write_text("  first line \n\n   \nsecond line\n", encoding="utf-8")
    assert read_texts(path) == ["first line", "second line"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_read_texts_jsonl_takes_the_text_field(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"texts{suffix}"
    lines = [json.dumps({"text": "one", "id": 1}), "", json.dumps({"text": "two"})]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert read_texts(str(path)) == ["one", "two"]


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("empty.txt", "", "holds no text"),
        ("blank.txt", "\n  \n", "holds no text"),
        ("empty.jsonl", "\n", "holds no text"),
        ("bad.jsonl", '{"text": "ok"}\n{"text": \n', r"bad\.jsonl:2: not valid JSON"),
        ("field.jsonl", '{"text": "ok"}\n\n{"body": "x"}\n', r':3: .*"text" field'),
        ("list.jsonl", '["text"]\n', r':1: .*"text" field'),
        ("type.jsonl", '{"text": 5}\n', r':1: "text" must be a string, got int'),
        ("blank.jsonl", '{"text": "  "}\n', r':1: "text" is empty'),
    ],
)
def test_read_texts_rejects_empty_or_malformed_files(
    tmp_path: Path, name: str, content: str, match: str
) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        read_texts(path)


def test_read_texts_rejects_a_missing_file_and_non_utf8(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_texts(tmp_path / "missing.txt")
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        read_texts(path)

"""Small text corpora for calibration, and a reader for your own.

`calibration_texts()` (200 sentences) and `heldout_texts()` (100 other
sentences) are short English sentences on varied topics (science, cooking,
travel, sport, history, technology, weather, finance, health, everyday
life), one per line, shipped in the package: nothing is downloaded.
`read_texts(path)` reads a `.txt` file (one text per line) or a JSON-lines
file (`.jsonl` / `.json`, one object with a `"text"` field per line).
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

__all__ = ["calibration_texts", "heldout_texts", "read_texts"]

_JSON_SUFFIXES = (".jsonl", ".json")


def _package_texts(name: str) -> list[str]:
    text = resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def calibration_texts() -> list[str]:
    """The packaged calibration corpus: 200 distinct sentences."""
    return _package_texts("calibration.txt")


def heldout_texts() -> list[str]:
    """The packaged held-out corpus: 100 sentences, none in the calibration one."""
    return _package_texts("heldout.txt")


def _json_line(path: Path, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
    if not isinstance(record, dict) or "text" not in record:
        raise ValueError(f'{path}:{number}: expected a JSON object with a "text" field')
    text = record["text"]
    if not isinstance(text, str):
        raise ValueError(
            f'{path}:{number}: "text" must be a string, got {type(text).__name__}'
        )
    if not text.strip():
        raise ValueError(f'{path}:{number}: "text" is empty')
    return text


def read_texts(path: str | os.PathLike[str]) -> list[str]:
    """The texts of a file: one per line.

    A `.jsonl` or `.json` file holds one JSON object per line, whose `"text"`
    field is taken; any other file is plain UTF-8 text, one text per line
    (surrounding whitespace stripped). Blank lines are skipped in both.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file holds no text, is not UTF-8, or a JSON line is
            malformed (the message names the file and the line number).
        OSError: the file cannot be read.
    """
    target = Path(path)
    if not target.is_file():
        raise FileNotFoundError(f"no such file: {target}")
    try:
        content = target.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{target}: not UTF-8 text ({err.reason})") from None
    is_json = target.suffix.lower() in _JSON_SUFFIXES
    texts: list[str] = []
    for number, raw in enumerate(content.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        texts.append(_json_line(target, number, line) if is_json else line)
    if not texts:
        raise ValueError(f"{target} holds no text (empty, or only blank lines)")
    return texts

"""The shipped benchmark reports: valid JSON that names no path of the machine that wrote them."""
import json
import re
from pathlib import Path

import pytest

RESULTS = sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*.json*"))
# a POSIX path from the filesystem root, a home folder, or a Windows drive
ABSOLUTE = re.compile(r'"(/(?:root|home|work|tmp|Users|var|opt|mnt|private)/[^"]*|~/[^"]*|[A-Za-z]:\\\\[^"]*)"')


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_report_is_valid_json_without_machine_paths(path):
    text = path.read_text()
    lines = text.splitlines() if path.suffix == ".jsonl" else [text]
    for line in filter(None, lines):
        json.loads(line)
    assert not ABSOLUTE.findall(text), f"{path.name} names machine paths: {ABSOLUTE.findall(text)[:3]}"


def test_the_check_catches_a_machine_path():
    assert ABSOLUTE.findall(json.dumps({"model": "/root/.cache/x/model"}))
    assert not ABSOLUTE.findall(json.dumps({"model": ".cache/peers/model", "ratio": "1/2"}))

"""The README is a map a newcomer reads in five minutes: at most 2,500 words (counted as `wc -w` counts them),
at most 300 lines, and no line of prose or code over 160 characters. Table rows are exempt (a headline row
carries its full command); the record and the long explanations live in docs/."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_WORDS = 2_500
MAX_LINES = 300
MAX_LINE_CHARS = 160


def word_count(text: str) -> int:
    """Words as `wc -w` counts them: runs of non-whitespace."""
    return len(text.split())


def long_lines(text: str) -> list[tuple[int, int]]:
    """(line number, length) of every line over MAX_LINE_CHARS that is not a table row."""
    return [(number, len(line)) for number, line in enumerate(text.splitlines(), 1)
            if len(line) > MAX_LINE_CHARS and not line.lstrip().startswith("|")]


def test_the_readme_is_at_most_2500_words():
    assert word_count(README.read_text()) <= MAX_WORDS


def test_the_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_no_readme_line_of_prose_or_code_is_over_160_characters():
    assert not long_lines(README.read_text()), "README lines over 160 characters (line, length)"


def test_the_checks_catch_a_long_line_and_too_many_words():
    prose = "word " * 40
    assert long_lines(f"# title\n{prose}\n| {prose} |\n    {prose}\n") == [(2, 200), (4, 204)]
    assert word_count("a  b\tc\nd-e `f`") == 5
    assert word_count("word " * (MAX_WORDS + 1)) > MAX_WORDS

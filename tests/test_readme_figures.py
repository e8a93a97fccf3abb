"""The README's few headline figures and the record's full table (docs/performance.md, "Headline figures")
are the numbers that the results JSON each row links holds; every relative link of the README and docs/
resolves; every flag of every command is in the command-line reference (docs/commands.md, "Command line").
The README's size: tests/test_readme_size.py.

A headline row's last cell links its JSON and names, in the link's title (hidden when rendered), one key
path per number of the value cell, in order: `[x.json](bench/results/x.json "rows.4.mean_increase")`, or
the same as a reference link, `[json][x]` with `[x]: bench/results/x.json "rows.4.mean_increase"` below.
Matching rule: a figure written with d decimals stands for the JSON number x when |x - figure| <= half a
unit of its last digit (0.5 * 10^-d), i.e. x rounds to it; a percentage may be a fraction (x * 100) or
already in percent; a sign is part of the figure; "1,024" is 1024; "×", "%" and bold are decoration.
The number at the named path must match, and so the figure is also found in the file.
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
COMMANDS = ROOT / "docs" / "commands.md"
RESULTS = ROOT / "bench" / "results"

NUMBER = re.compile(r"(?<![\w.,])([+-]?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(%?)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"([^\"]*)\")?\)")
REFERENCE_LINK = re.compile(r"\[([^\]]*)\]\[([^\]]+)\]")
DEFINITION = re.compile(r"^\[([^\]]+)\]:\s+(\S+)(?:\s+\"([^\"]*)\")?\s*$", re.M)
CELL_SPLIT = re.compile(r"(?<!\\)\|")


@dataclass(frozen=True, slots=True)
class Figure:
    text: str
    value: float
    decimals: int
    is_percent: bool


def figures_in(cell: str) -> list[Figure]:
    """The numbers of a value cell, left to right ("+0.5%, 4.68" -> two figures)."""
    found = []
    for match in NUMBER.finditer(cell.replace("**", "")):
        sign, whole, fraction, percent = match.groups()
        magnitude = float(whole.replace(",", "") + (fraction or ""))
        found.append(Figure(match.group(0), -magnitude if sign == "-" else magnitude,
                            len(fraction) - 1 if fraction else 0, percent == "%"))
    return found


def matches(figure: Figure, number: float) -> bool:
    """The matching rule of the module docstring."""
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        return False
    tolerance = 0.5 * 10 ** -figure.decimals + 1e-9
    candidates = [number, number * 100] if figure.is_percent else [number]
    return any(abs(candidate - figure.value) <= tolerance for candidate in candidates)


def numbers_in(document) -> list[float]:
    """Every number anywhere in a parsed JSON document, walked recursively."""
    if isinstance(document, dict):
        return [n for value in document.values() for n in numbers_in(value)]
    if isinstance(document, list):
        return [n for value in document for n in numbers_in(value)]
    return [document] if isinstance(document, (int, float)) and not isinstance(document, bool) else []


def at_path(document, path: str):
    for key in path.split("."):
        document = document[int(key)] if isinstance(document, list) else document[key]
    return document


def load_results(path: Path):
    """A JSON file, or a JSON Lines file as the list of its lines."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def tables(text: str) -> list[list[dict[str, str]]]:
    """Markdown tables as lists of rows keyed by the header's cells."""
    found, lines = [], text.splitlines()
    for start, line in enumerate(lines):
        if line.startswith("|") and (start == 0 or not lines[start - 1].startswith("|")):
            end = next((k for k in range(start, len(lines)) if not lines[k].startswith("|")), len(lines))
            cells = [[c.strip() for c in CELL_SPLIT.split(row.strip())[1:-1]] for row in lines[start:end]]
            found.append([dict(zip(cells[0], row)) for row in cells[2:]])
    return found


def check_headline_row(row: dict[str, str], page: Path = README) -> list[str]:
    """What is wrong with one headline row of `page` (nothing: an empty list)."""
    link = LINK.search(row["results"])
    if not link:
        return [f"no results link in {row['results']!r}"]
    target, title = link.groups()
    path = (page.parent / target).resolve()
    if not path.is_relative_to(RESULTS) or not path.is_file():
        return [f"{target} is not a file under bench/results/"]
    document = load_results(path)
    figures, key_paths = figures_in(row["value"]), (title or "").split()
    if not figures or len(figures) != len(key_paths):
        return [f"{row['value']!r} has {len(figures)} figures but the link names {len(key_paths)} key paths"]
    errors = []
    everything = numbers_in(document)
    for figure, key_path in zip(figures, key_paths):
        try:
            number = at_path(document, key_path)
        except (KeyError, IndexError, ValueError, TypeError):
            errors.append(f"{target} has no {key_path}")
            continue
        if not matches(figure, number):
            errors.append(f"{figure.text} is not {target}:{key_path} = {number}")
        elif not any(matches(figure, n) for n in everything):
            errors.append(f"{figure.text} is nowhere in {target}")
    return errors


def with_inline_links(text: str) -> str:
    """Reference links written out inline: `[json][x]` -> `[json](target "title")`; unknown labels stay."""
    definitions = {label.lower(): (target, title) for label, target, title in DEFINITION.findall(text)}

    def inline(match: re.Match) -> str:
        if match.group(2).lower() not in definitions:
            return match.group(0)
        target, title = definitions[match.group(2).lower()]
        return f'[{match.group(1)}]({target} "{title}")' if title else f"[{match.group(1)}]({target})"

    return REFERENCE_LINK.sub(inline, text)


def headline_rows(text: str) -> list[dict[str, str]]:
    (rows,) = tables(section(with_inline_links(text), "Headline figures"))
    return rows


HEADLINE_PAGES = [README, PERFORMANCE]
HEADLINE_ROWS = [(page, row) for page in HEADLINE_PAGES for row in headline_rows(page.read_text())]


MARKDOWN_PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _without_code(text: str) -> str:
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


@pytest.mark.parametrize("page", MARKDOWN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    text = _without_code(page.read_text())
    for target, _ in LINK.findall(text) + [(target, title) for _, target, title in DEFINITION.findall(text)]:
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{page.name}: links that resolve to nothing: {broken}"


@pytest.mark.parametrize("page", HEADLINE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_readme_and_the_record_have_headline_figures(page):
    rows = headline_rows(page.read_text())
    assert len(rows) >= 10
    for row in rows:
        assert row["command"] and row["machine"] and re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), row


@pytest.mark.parametrize("page, row", HEADLINE_ROWS,
                         ids=[f"{p.name}: {r['figure'][:60]}" for p, r in HEADLINE_ROWS])
def test_headline_figure_is_the_number_in_its_results_json(page, row):
    assert not check_headline_row(row, page)


def _results_file(row: dict[str, str], page: Path) -> Path:
    return (page.parent / LINK.search(row["results"]).group(1)).resolve()


def test_every_readme_figure_is_in_the_record_with_its_command():
    """The README picks from the record: the same value, command and JSON file in docs/performance.md."""
    record = [(r["value"], r["command"], _results_file(r, PERFORMANCE)) for r in headline_rows(PERFORMANCE.read_text())]
    missing = [row["figure"] for row in headline_rows(README.read_text())
               if (row["value"], row["command"], _results_file(row, README)) not in record]
    assert not missing, f"README figures not in docs/performance.md's headline table: {missing}"


def test_the_matcher_rejects_wrong_figures():
    (tokens_per_pass,) = figures_in("**4.60**")
    assert matches(tokens_per_pass, 4.5958) and not matches(tokens_per_pass, 4.61) and not matches(tokens_per_pass, 4.5)
    (ratio,) = figures_in("2.29×")
    assert matches(ratio, 2.285) and not matches(ratio, 2.30)
    (increase,) = figures_in("+0.5%")
    assert matches(increase, 0.005) and matches(increase, 0.5) and not matches(increase, 0.006)
    assert not matches(increase, -0.005)
    (count,) = figures_in("42×")
    assert matches(count, 42.37) and not matches(count, 43)
    assert [f.value for f in figures_in("0.968-0.997")] == [0.968, 0.997]
    assert [f.value for f in figures_in("1,024 and -3.2%")] == [1024, -3.2]
    assert not matches(tokens_per_pass, True)


def test_reference_links_are_written_out_inline():
    text = 'a [json][x] and [y][unknown]\n\n[x]: bench/results/x.json "rows.0.value"\n'
    assert with_inline_links(text).startswith('a [json](bench/results/x.json "rows.0.value") and [y][unknown]')


def test_a_wrong_figure_in_the_readme_fails():
    row = next(r for r in headline_rows(README.read_text()) if "4.60" in r["value"])
    assert not check_headline_row(row)
    assert check_headline_row(row, PERFORMANCE)                              # its link read from docs/
    assert check_headline_row({**row, "value": row["value"].replace("4.60", "4.70")})
    assert check_headline_row({**row, "results": row["results"].replace("tokens_per_pass", "tokens_per_second")})
    assert check_headline_row({**row, "value": row["value"] + ", 3.00"})      # a figure with no key path


def _leaf_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers and path:
        yield " ".join(path), {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    for action in subparsers:
        for name, sub in action.choices.items():
            yield from _leaf_commands(sub, path + (name,))


FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def test_every_flag_of_every_command_is_in_the_command_line_reference():
    from commands import build_parser

    reference = section(COMMANDS.read_text(), "Command line")
    flag_tables = [t for t in tables(reference) if t and "flag" in t[0]]
    model_flags, sampling_flags = ({f for row in t for f in FLAG.findall(row["flag"])} for t in flag_tables)
    (command_rows,) = [t for t in tables(reference) if t and "command" in t[0]]
    problems = []
    for command, flags in _leaf_commands(build_parser()):
        row = next((r for r in command_rows if re.match(rf"`{re.escape(command)}(`| )", r["command"])), None)
        if row is None:
            problems.append(f"{command}: no row")
            continue
        own = set(FLAG.findall(row["its own flags"]))
        allowed = own | (model_flags if "model" in row["its own flags"] else set()) | \
            (sampling_flags if "sampling" in row["its own flags"] else set())
        problems += [f"{command}: {flag} undocumented" for flag in sorted(flags - allowed)]
        problems += [f"{command}: {flag} documented but not a flag" for flag in sorted(own - flags)]
    assert not problems, problems

"""The README's two commands are what CI runs: the same strings, in the same order, in `.ci/run`."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_readme_has_a_setup_and_run_command_and_a_test_command():
    first, second = readme_commands()
    assert first.startswith("bash scripts/setup.sh &&") and "--dev" not in first and "cli.py run" in first
    assert second.startswith("bash scripts/setup.sh --dev &&") and "pytest" in second


def test_ci_runs_the_readme_commands_verbatim_and_in_order():
    ci_lines = [line.strip() for line in ROOT.joinpath(".ci", "run").read_text().splitlines()]
    positions = [ci_lines.index(command) for command in readme_commands()]
    assert positions == sorted(positions)


def test_ci_gives_the_first_command_an_empty_model_cache():
    script = ROOT.joinpath(".ci", "run").read_text()
    fresh = re.search(r'SPECSTREAM_CACHE="\$\(mktemp -d\)"', script)
    assert fresh and fresh.start() < script.index(readme_commands()[0])
    assert "export SPECSTREAM_CACHE" in script

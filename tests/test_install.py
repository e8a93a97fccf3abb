"""A non-editable install works on its own: `pip install --no-deps --target DIR .`, then the console
command from another directory, importing nothing but what was installed (no `tests/`, no results JSON), `bench`
commands included."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return target


def specstream(installed: Path, *args: str, stdin: str | None = None, timeout: int = 180):
    elsewhere = installed.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(installed)}
    return subprocess.run([str(installed / "bin" / "specstream"), *args], capture_output=True, text=True,
                          cwd=elsewhere, env=env, input=stdin, timeout=timeout)


def test_installed_modules_come_from_the_install_not_the_checkout(installed):
    probe = ("import cli, offload, runtime, spec, server, commands.bench, bench.stream_bench, textdata;"
             "print(cli.__file__); print(offload.__file__)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=installed.parent,
                          env={**os.environ, "PYTHONPATH": str(installed)})
    assert done.returncode == 0, done.stderr
    assert all(Path(line).is_relative_to(installed) for line in done.stdout.split())
    assert (installed / "spec" / "drafts" / "smollm2-135m-instruct" / "config.json").exists()
    assert (installed / "textdata" / "mt_bench" / "question.jsonl").exists()
    assert not (installed / "bench" / "results").exists() and not (installed / "tests").exists()


def test_installed_run_plan_bench_and_chat(installed):
    run = specstream(installed, "run", "What is 2+2?", "--max-new-tokens", "8", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["text"].startswith("The answer to this")
    plan = specstream(installed, "plan", "--json")
    assert plan.returncode == 0, plan.stderr
    assert "predicted_transfer_seconds_per_pass" in json.loads(plan.stdout)
    bench = specstream(installed, "bench", "stream", "--gpu-mem", "300MiB", "--tokens", "1", "--repeats", "1",
                       "--json")
    assert bench.returncode == 0, bench.stderr
    assert json.loads(bench.stdout.strip().splitlines()[-1])["passes"][0]["tokens"] == 1
    chat = specstream(installed, "chat", "--max-new-tokens", "8", "--temperature", "0", stdin="What is 2+2?\n/quit\n")
    assert chat.returncode == 0, chat.stderr
    assert "The answer to this" in chat.stdout

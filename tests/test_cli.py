"""The command line as a user drives it: subprocesses on the embedded default model."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.e2e


def cli(*args, timeout=120, **kwargs):
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, **kwargs)


def test_run_json_reports_text_and_stats():
    result = cli("run", "What is 2+2?", "--json", "--no-draft")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["text"] == "The answer to this classic math problem is 4."
    for key in ("num_prompt_tokens", "num_new_tokens", "num_target_passes", "tokens_per_pass", "seconds",
                "tokens_per_second", "peak_device_bytes", "bytes_streamed"):
        assert key in report
    assert report["num_new_tokens"] == report["num_target_passes"] and report["tokens_per_pass"] == 1.0
    assert report["peak_device_bytes"] > 100e6 and report["speculative"] is False


def test_run_speculates_by_default_with_the_shipped_draft():
    result = cli("run", "Name three primary colors and one fact about each.", "--json", "--budget", "16",
                 "--max-new-tokens", "48")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    reference = json.loads(cli("run", "Name three primary colors and one fact about each.", "--json", "--no-draft",
                               "--max-new-tokens", "48").stdout)
    assert report["text"] == reference["text"] and report["speculative"] is True
    speculation = report["speculation"]
    assert speculation["budget"]["last"] == 16 and report["num_target_passes"] < reference["num_target_passes"]
    assert report["tokens_per_pass"] > 1.3
    assert sum(speculation["tokens_per_pass_histogram"].values()) == speculation["num_steps"]
    assert 1 >= speculation["acceptance_by_depth"][0] >= speculation["acceptance_by_depth"][-1] > 0
    assert set(speculation["seconds_per_step"]) == {"draft", "target", "overhead"}


@pytest.mark.parametrize("budget", ["0", "9000", "big"])
def test_budget_outside_the_range_is_refused_with_the_range(budget):
    result = cli("run", "hi", "--budget", budget)
    assert result.returncode == 2 and "[1, 8192]" in result.stderr and "Traceback" not in result.stderr


def test_a_draft_that_cannot_load_falls_back_with_one_warning(tmp_path):
    from offload.weights.resolve import resolve_model
    default = resolve_model(None)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((default / name).read_text())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    result = cli("run", "What is 2+2?", "--draft", str(tmp_path), "--json", "--max-new-tokens", "12")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["text"] == "The answer to this classic math problem is 4." and report["speculative"] is False
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "could not be loaded" in result.stderr


def test_run_streams_text_and_raw_mode_skips_template():
    streamed = cli("run", "What is 2+2?", "--max-new-tokens", "8")
    assert streamed.returncode == 0 and streamed.stdout.startswith("The answer to this")
    raw = cli("run", "The capital of France is", "--raw", "--max-new-tokens", "4", "--json")
    assert json.loads(raw.stdout)["num_prompt_tokens"] == 5


@pytest.mark.parametrize("args, fragment", [
    (["run", "hi", "--target", "/no/such/model"], "model not found"),
    (["run", "hi", "--temperature", "-1"], "temperature"),
    (["run", "hi", "--top-p", "0"], "top-p"),
    (["batch", "/no/such/file.jsonl", "-o", "/tmp/x.jsonl"], "batch input not found"),
    (["bench", "stream", "--gpu-mem", "64GiB", "--tokens", "1"], "leaves no decoder layer on the ram tier"),
    (["distill", "--out", "/tmp/never-written", "--batch-size", "0"], "batch_size must be positive"),
    (["distill", "--out", "/tmp/never-written", "--batch-tokens", "0"], "batch tokens > 0"),
])
def test_user_errors_are_one_line_without_traceback(args, fragment):
    result = cli(*args)
    assert result.returncode == 2
    assert fragment in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bench_stream_compares_passes_with_the_tier_bandwidth():
    result = cli("bench", "stream", "--gpu-mem", "300MiB", "--tokens", "1,4", "--repeats", "1", "--json",
                 "--beside-compute")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["layers"]["ram"] > 0 and [row["tokens"] for row in report["passes"]] == [1, 4]
    for row in report["passes"]:          # efficiencies are rounded to 4 places: abs=1e-4
        assert row["bytes_streamed"] == report["layers"]["ram"] * report["layer_bytes"]
        assert row["raw_gbps"] > 0 and 0 < row["efficiency"] == pytest.approx(
            row["bytes_streamed"] / (row["raw_gbps"] * 1e9) / row["pass_seconds"], rel=0.01, abs=1e-4)
        assert row["raw_gbps_beside_compute"] > 0 and row["efficiency_vs_raw_beside_compute"] == pytest.approx(
            row["bytes_streamed"] / (row["raw_gbps_beside_compute"] * 1e9) / row["pass_seconds"], rel=0.01, abs=1e-4)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    result = cli("run", "hi", "--target", str(tmp_path))
    assert result.returncode == 2 and "GPT2LMHeadModel" in result.stderr and "LlamaForCausalLM" in result.stderr


def test_help_lists_flags_with_defaults():
    result = cli("run", "--help")
    for flag in ("--target", "--draft", "--no-draft", "--max-new-tokens", "--temperature", "--top-p", "--top-k",
                 "--seed", "--device", "--dtype"):
        assert flag in result.stdout
    assert "default" in result.stdout


def test_batch_killed_midway_resumes_without_loss_or_duplicates(tmp_path):
    """The kill lands at a known point: two short requests finish first, the rest are long, and SIGKILL is
    sent as soon as the two results are on disk (a long request cannot finish in the polling interval)."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"id": f"q{i}", "prompt": f"Count from {i} to {i + 2}.", "max_tokens": 4}) for i in range(2)]
    lines += [json.dumps({"id": f"q{i}", "prompt": f"Tell a long story about a lighthouse keeper, part {i}.",
                          "max_tokens": 160}) for i in range(2, 6)]
    lines.insert(3, "{this line is broken")
    source.write_text("\n".join(lines) + "\n")
    args = [sys.executable, str(ROOT / "cli.py"), "batch", str(source), "-o", str(out)]
    process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 2):
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert sorted(before) == ["q0", "q1"], "SIGKILL lands after exactly the two short results"
    resumed = cli("batch", str(source), "-o", str(out))
    assert resumed.returncode == 3 and "line 4" in resumed.stderr
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == [f"q{i}" for i in range(6)] and len(ids) == 6


def test_corrupt_weights_are_rejected_before_generation(tmp_path):
    from conftest import make_tiny_checkpoint
    folder, _ = make_tiny_checkpoint(tmp_path / "model", "llama")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])        # truncated: the last tensor's bytes are gone
    result = cli("run", "hi", "--target", str(folder))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(weights) in result.stderr.replace("\n", "") and "truncated" in result.stderr


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    from offload.weights.resolve import resolve_model
    default = resolve_model(None)
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_text((default / name).read_text())
    settings = json.loads((default / "tokenizer_config.json").read_text())
    settings["eos_token"] = "<|endoftext|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    result = cli("run", "hi", "--draft", str(tmp_path), "--max-new-tokens", "1")
    assert result.returncode == 2 and "does not share the tokenizer" in result.stderr and "eos_token" in result.stderr


def test_shipped_draft_is_the_default_pair_and_runs_alone():
    report = json.loads(cli("run", "What is 2+2?", "--json", "--max-new-tokens", "4").stdout)
    assert report["draft"].endswith("spec/drafts/smollm2-135m-instruct")
    assert json.loads(cli("run", "hi", "--json", "--no-draft", "--max-new-tokens", "1").stdout)["draft"] is None
    alone = cli("run", "What is 2+2?", "--target", str(ROOT / "spec" / "drafts" / "smollm2-135m-instruct"), "--json",
                "--max-new-tokens", "8")
    assert alone.returncode == 0 and 1 <= json.loads(alone.stdout)["num_new_tokens"] <= 8


def test_shipped_judge_is_lossy_and_says_so_and_threshold_zero_is_exact():
    prompt = "Tom has 3 boxes of 12 pencils and gives away 7. How many pencils are left?"
    exact = json.loads(cli("run", prompt, "--no-draft", "--max-new-tokens", "64", "--json").stdout)
    # threshold 1 accepts every mismatch (p(important) < 1): on this prompt the judge takes draft tokens
    # against the target's choice and the answer leaves the target's greedy text (measured: 3 tokens)
    judged = cli("run", prompt, "--judge", "default", "--judge-threshold", "1.0", "--budget", "16",
                 "--max-new-tokens", "64", "--json")
    assert judged.returncode == 0, judged.stderr
    report = json.loads(judged.stdout)
    assert report["lossy"] is True and report["judge_threshold"] == 1.0
    assert report["judge_accepted"] > 0 and report["text"] != exact["text"]
    strict = json.loads(cli("run", prompt, "--judge", "default", "--judge-threshold", "0", "--budget", "16",
                            "--max-new-tokens", "64", "--json").stdout)
    assert strict["text"] == exact["text"] and strict["judge_accepted"] == 0
    footer = cli("run", prompt, "--judge", "default", "--budget", "16", "--max-new-tokens", "16").stderr
    assert "LOSSY: judge accepted" in " ".join(footer.split())   # the footer goes to stderr


@pytest.mark.parametrize("args, fragment", [
    (["--judge", "default", "--judge-threshold", "1.5"], "[0, 1]"),
    (["--judge", "/no/such/judge.safetensors"], "judge file not found"),
    (["--judge", "default", "--no-draft"], "needs a draft"),
])
def test_bad_judge_flags_are_one_line(args, fragment):
    result = cli("run", "hi", *args)
    assert result.returncode == 2 and fragment in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_batch_with_the_judge_says_it_is_lossy(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "What is 3+4?"}) + "\n")
    result = cli("batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--judge", "default",
                 "--max-new-tokens", "16")
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stderr.split())                     # rich wraps lines at the terminal width
    assert "lossy decoding" in said and "lossy: the judge accepted" in said
    assert json.loads((tmp_path / "out.jsonl").read_text())["custom_id"] == "a"


def test_run_reads_the_prompt_from_stdin():
    piped = cli("run", "-", "--json", "--no-draft", input="What is 2+2?\n")
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["text"] == "The answer to this classic math problem is 4."
    empty = cli("run", "-", "--no-draft", input="  \n")
    assert empty.returncode != 0 and "no prompt on stdin" in empty.stderr and "Traceback" not in empty.stderr


def test_seeded_batch_answers_do_not_depend_on_the_batch(tmp_path):
    """Sampled requests with seeds, the shipped draft, --budget auto: batch-size 1 and the auto batch (six
    at once, trees split between them) write the same texts; another seed writes another text."""
    questions = ["What is 2+2?", "Name a color.", "Say hi.", "What is the capital of France?", "Count to three.",
                 "What is 3*3?"]

    def lines(seed_offset: int) -> str:
        return "\n".join(json.dumps({"custom_id": f"r{i}", "body": {
            "messages": [{"role": "user", "content": q}], "max_tokens": 16, "temperature": 0.7,
            "seed": i + seed_offset}}) for i, q in enumerate(questions)) + "\n"

    def texts(source: Path, *flags: str) -> dict[str, str]:
        out = source.with_suffix(f".{len(flags)}.out.jsonl")
        result = cli("batch", str(source), "-o", str(out), *flags, timeout=240)
        assert result.returncode == 0, result.stderr
        assert ("in flight" in result.stdout + result.stderr) == (not flags)     # auto decoded them together
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        return {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in rows}

    source, other = tmp_path / "in.jsonl", tmp_path / "other.jsonl"
    source.write_text(lines(0))
    other.write_text(lines(100))
    together = texts(source)
    assert texts(source, "--batch-size", "1") == together
    assert texts(other) != together

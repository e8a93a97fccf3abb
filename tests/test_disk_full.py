"""A full disk is a message, not a traceback: every writer that keeps long work on disk (batch output,
quantize checkpoints, distillation checkpoints and corpus, the GGUF cache, bench journals) stops on ENOSPC
with one line naming the file, what is saved and the command that continues; once there is room again
that command finishes the work with nothing lost or duplicated. The disk fills by a patched os.fsync /
os.write that fails on the file under test."""
from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

import cli
from conftest import add_tiny_tokenizer, make_tiny_checkpoint
from bench.journal import BenchJournal
from offload.weights.disk_errors import StorageFullError
from offload.weights.gguf_import import gguf_cache_dir, import_gguf
from quant.checkpoint import layer_path
from quant.quantize import QuantizeConfig, quantize
from runtime import run_batch
from spec import SamplingConfig
from spec.distill import DistillConfig, distill
from spec.distill.generate import GenerationConfig
from test_distill import _write_tokenizer
from test_gguf_import import Spec, write_gguf

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names open files through /proc")
FULL = "No space left on device"


def fill_disk(monkeypatch, call: str, matches: Callable[[str], bool], skip: int = 0) -> list[str]:
    """os.<call>(fd, ...) raises ENOSPC once, on the (skip + 1)-th call whose file's path matches;
    returns the list the failing path is appended to."""
    real, seen, failed = getattr(os, call), [0], []

    def full(fd, *args):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if not failed and matches(path):
            seen[0] += 1
            if seen[0] > skip:
                failed.append(path)
                raise OSError(errno.ENOSPC, FULL)
        return real(fd, *args)

    monkeypatch.setattr(os, call, full)
    return failed


# -- batch, through the CLI -------------------------------------------------------------------------

def test_batch_stops_in_one_line_and_a_rerun_completes_it(tmp_path, monkeypatch, capsys):
    inputs, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inputs.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in [("a", "hi"), ("b", "2+2?"),
                                                                                      ("c", "hello")]))
    argv = ["batch", str(inputs), "-o", str(out), "--max-new-tokens", "2", "--no-draft"]
    assert fill_disk(monkeypatch, "fsync", lambda path: path == str(out), skip=1) == []
    assert cli.main(argv) == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: disk full writing {out} ({FULL}); saved: 1 of 3 answers in {out}; free space, then "
                      f"rerun `specstream batch {inputs} -o {out}` with the same flags (answered ids are skipped)"]
    assert "Traceback" not in stderr
    saved = out.read_text().splitlines()
    assert len(saved) == 1 and json.loads(saved[0])["custom_id"] == "a"      # the failed line was cut back
    monkeypatch.undo()          # room again: the same run resumes (a stub model: loading the real one once is enough)
    report = {"num_prompt_tokens": 1, "num_new_tokens": 1, "stop_reason": "length"}
    summary = run_batch(inputs, out, lambda item, sampling, max_tokens: ("ok", report), SamplingConfig(), 2, "stub")
    assert summary.num_done_before == 1 and summary.num_completed == 2
    lines = out.read_text().splitlines()
    assert lines[0] == saved[0] and [json.loads(line)["custom_id"] for line in lines] == ["a", "b", "c"]


# -- quantize -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    folder, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("quant") / "dense", "llama", num_hidden_layers=2,
                                     vocab_size=64)
    return add_tiny_tokenizer(folder, 64)


def test_quantize_stopped_between_its_state_writes_resumes_exactly(tiny_source, tmp_path, monkeypatch):
    out = tmp_path / "w3"
    config = QuantizeConfig(str(tiny_source), out, bits=3, outlier_threshold=1.0, nsamples=8, seqlen=32)
    # progress.json is written at the start and after each layer: fail layer 0's, after its hidden state
    fill_disk(monkeypatch, "fsync", lambda path: path.endswith("progress.json.tmp"), skip=1)
    with pytest.raises(StorageFullError) as err:
        quantize(config)
    assert str(err.value) == (f"disk full writing {out / '.state' / 'progress.json'} ({FULL}); saved: 0 of 2 "
                              f"layers in {out}; free space, then rerun `specstream quantize --out {out} --resume` "
                              "with the same flags")
    assert not list(out.rglob("*.tmp"))
    monkeypatch.undo()
    config.resume, seen = True, []
    summary = quantize(config, lambda event: seen.append(event["layer"]))
    assert seen == [1] and summary["layers"] == 2
    complete = quantize(QuantizeConfig(str(tiny_source), tmp_path / "complete", bits=3, outlier_threshold=1.0,
                                       nsamples=8, seqlen=32))
    assert summary["bits_per_param"] == complete["bits_per_param"]
    for index in range(2):
        assert layer_path(out, index).read_bytes() == layer_path(tmp_path / "complete", index).read_bytes()


# -- distill ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    folder, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=3, bos_token_id=1,
                                     num_hidden_layers=2, eos_token_id=2)
    _write_tokenizer(folder)
    return folder


def test_distill_stopped_at_a_checkpoint_resumes_from_the_last_one(chat_target, tmp_path, monkeypatch):
    out = tmp_path / "draft"
    generation = GenerationConfig(batch_size=4, max_new_tokens=4, max_prompt_tokens=200, top_k=4, prefill_chunk=64)
    config = DistillConfig(str(chat_target), out, num_layers=1, vocab_top=64, num_steps=3, batch_tokens=128,
                           num_self_prompts=0, num_template_prompts=2, max_gsm8k_prompts=2, max_prompts=4,
                           num_sampled_prompts=0, generation=generation, device="cpu", dtype="fp32",
                           checkpoint_seconds=0.0)
    fill_disk(monkeypatch, "fsync", lambda path: re.search(r"checkpoint\.safetensors\.[\w-]+\.tmp$", path), skip=1)
    with pytest.raises(StorageFullError) as err:
        distill(config)
    work = out / "training"
    assert str(err.value) == (f"disk full writing {work / 'checkpoint.safetensors'} ({FULL}); saved: the answers "
                              f"collected in {work / 'corpus'} and the training checkpoint at step 1; free space, "
                              f"then rerun `specstream distill --out {out} --resume` with the same flags")
    records = sorted((work / "corpus").glob("records-*.jsonl"))
    collected = [path.read_text() for path in records]
    monkeypatch.undo()
    config.resume, events = True, []
    assert distill(config, events.append)["steps"] == 3
    assert next(e for e in events if e["phase"] == "train_start")["resumed_at"] == 1
    assert [path.read_text() for path in records] == collected        # no answer generated twice


# -- the GGUF cache -----------------------------------------------------------------------------------

def test_a_gguf_conversion_on_a_full_disk_removes_its_partial_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    gguf_path = write_gguf(tmp_path / "tiny.gguf", Spec())
    folder, real_fsync = gguf_cache_dir(gguf_path), os.fsync
    fill_disk(monkeypatch, "fsync", lambda path: re.search(r"\.safetensors\.[\w-]+\.tmp$", path))
    with pytest.raises(StorageFullError) as err:
        import_gguf(gguf_path)
    message = str(err.value)
    assert message.startswith(f"disk full writing {folder.with_name(folder.name + '.partial')}/model.safetensors (")
    assert "saved: nothing (the partial conversion was removed); free space, then rerun the command: the " \
           "conversion starts over and needs " in message and f"MiB in {tmp_path / 'cache'} " in message
    assert not folder.with_name(folder.name + ".partial").exists() and not folder.exists()
    monkeypatch.setattr(os, "fsync", real_fsync)           # room again: the rerun converts
    assert (import_gguf(gguf_path) / "import.json").exists()


# -- bench journals -----------------------------------------------------------------------------------

def test_a_bench_journal_keeps_whole_rows_only(tmp_path, monkeypatch):
    journal = BenchJournal("spec", {"budgets": [4]}, resume=False, folder=tmp_path)
    journal.put({"tokens": 1}, "p0", 4)
    real_write, calls = os.write, []

    def torn(fd, data):      # the row's first write lands half its bytes, the next finds the disk full
        if os.readlink(f"/proc/self/fd/{fd}") != str(journal.path):
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, FULL)
        return real_write(fd, bytes(data[:len(data) // 2]))

    monkeypatch.setattr(os, "write", torn)
    with pytest.raises(StorageFullError) as err:
        journal.put({"tokens": 2}, "p1", 4)
    assert str(err.value) == (f"disk full writing {journal.path} ({FULL}); saved: 1 finished rows in "
                              f"{journal.path}; free space, then rerun the same `specstream bench spec` command "
                              "with --resume")
    monkeypatch.undo()
    resumed = BenchJournal("spec", {"budgets": [4]}, resume=True, folder=tmp_path)
    assert resumed.rows == {("p0", 4): {"tokens": 1}} and len(journal.path.read_text().splitlines()) == 2

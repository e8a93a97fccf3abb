"""Files a user hands us are checked before use: a judge file, a draft folder and a distillation checkpoint
with wrong shapes, a wrong target fingerprint, missing keys or a truncated tensor are refused with one
line (a ValueError) naming the file and the problem, never a traceback. Each broken file is made from a
valid one: the shipped judge and draft, and a checkpoint of a tiny training run."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from offload import LoadOptions
from offload.weights.resolve import resolve_model
from offload.weights.safetensors_io import SafetensorsFile, write_safetensors
from offload.model.config import ModelConfig
from offload.weights.formats import open_source
from judge.policy import load_judge_for
from runtime.speculation import estimated_draft_footprint
from spec.distill import load_draft_module
from spec.draft import load_draft
from test_no_pickle import tiny_trainer

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DRAFT = ROOT / "spec" / "drafts" / "smollm2-135m-instruct"
SHIPPED_JUDGE = ROOT / "judge" / "data" / "smollm2-135m-instruct.judge.safetensors"
OTHER_TARGET = "(49152, 576):0123456789abcdef"


def rewrite(path: Path, change: Callable[[dict, dict], None]) -> None:
    """Rewrites a safetensors file after change(tensors, metadata) edits them in place."""
    opened = SafetensorsFile(path)
    tensors, metadata = {name: opened.tensor(name).clone() for name in opened.entries}, dict(opened.metadata)
    opened.close()
    change(tensors, metadata)
    write_safetensors(path, tensors, metadata)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1000])


def one_line(err: pytest.ExceptionInfo, path: Path) -> str:
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message and str(path) in message, message
    return message


@pytest.fixture(scope="module")
def default_embed():
    folder = resolve_model(None)
    return open_source(folder, ModelConfig.from_file(folder)).global_tensors()["embed"]       # [V, H]


# -- judge files ------------------------------------------------------------------------------------

JUDGE_BREAKS = {
    "shapes": (lambda t, m: t.update(mean=torch.zeros(577)), "judge tensors have inconsistent shapes (mean [577]"),
    "fingerprint": (lambda t, m: m.update(target=OTHER_TARGET), "was trained for another target"),
    "missing": (lambda t, m: t.pop("thresholds"), "lacks thresholds: not a complete judge file"),
    "truncated": (truncate, "(truncated)"),
}


@pytest.mark.parametrize("broken", JUDGE_BREAKS)
def test_a_broken_judge_file_is_refused_in_one_line(tmp_path, default_embed, broken):
    path = tmp_path / "judge.safetensors"
    shutil.copyfile(SHIPPED_JUDGE, path)
    assert load_judge_for(str(path), default_embed, 576).hidden_size == 576      # the valid start loads
    change, expected = JUDGE_BREAKS[broken]
    if broken == "truncated":
        change(path)
    else:
        rewrite(path, change)
    with pytest.raises(ValueError) as err:
        load_judge_for(str(path), default_embed, 576)
    assert expected in one_line(err, path)


def test_a_broken_judge_through_the_cli_is_one_error_line(tmp_path):
    path = tmp_path / "judge.safetensors"
    shutil.copyfile(SHIPPED_JUDGE, path)
    truncate(path)
    done = subprocess.run([sys.executable, str(ROOT / "cli.py"), "run", "hi", "--judge", str(path),
                           "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and str(path) in errors[0] and "Traceback" not in done.stderr


# -- draft folders ----------------------------------------------------------------------------------

def _break_block(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["specstream_draft"].update(changes)
    config["specstream_draft"] = {k: v for k, v in config["specstream_draft"].items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))


DRAFT_BREAKS = {
    "shapes": (lambda f: rewrite(f / "model.safetensors", lambda t, m: t.update({"lm_head.bias": torch.zeros(4097)})),
               "tensor 'lm_head.bias' has shape [4097], config.json implies [4096]"),
    "fingerprint": (lambda f: _break_block(f, target_embedding_fingerprint=OTHER_TARGET),
                    "was distilled from a target whose embedding differs"),
    "embedding shape": (lambda f: _break_block(f, target_embedding_fingerprint="(100, 576):0123456789abcdef"),
                        "whose embedding is (100, 576), this target's is (49152, 576)"),
    "missing tensor": (lambda f: rewrite(f / "model.safetensors",
                                         lambda t, m: t.pop("model.layers.1.mlp.down_proj.weight")),
                       "lacks 1 of the 31 tensors config.json implies, first 'model.layers.1.mlp.down_proj.weight'"),
    "missing key": (lambda f: _break_block(f, target_embedding_fingerprint=None),
                    "specstream_draft block lacks target_embedding_fingerprint"),
    "bad config": (lambda f: (f / "config.json").write_text("{not json"), "config.json is not valid JSON"),
    "truncated": (lambda f: truncate(f / "model.safetensors"), "(truncated)"),
}


@pytest.mark.parametrize("broken", DRAFT_BREAKS)
def test_a_broken_draft_folder_is_refused_in_one_line(tmp_path, default_embed, broken):
    folder = tmp_path / "draft"
    shutil.copytree(SHIPPED_DRAFT, folder)
    change, expected = DRAFT_BREAKS[broken]
    change(folder)
    options = LoadOptions(str(folder), device="cpu", dtype="fp32")
    with pytest.raises(ValueError) as err:     # the fingerprint is checked where the draft reads its target's
        load_draft(options) if broken == "fingerprint" else load_draft(options, embed=default_embed)
    assert expected in one_line(err, folder)


def test_a_draft_module_for_training_is_checked_too(tmp_path, default_embed):
    folder = tmp_path / "draft"
    shutil.copytree(SHIPPED_DRAFT, folder)
    assert load_draft_module(folder, default_embed).vocab_top == 4096
    DRAFT_BREAKS["shapes"][0](folder)
    with pytest.raises(ValueError) as err:
        load_draft_module(folder, default_embed)
    assert DRAFT_BREAKS["shapes"][1] in one_line(err, folder)


def _edit_config(folder: Path, change: Callable[[dict], None]) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def _config_as_directory(folder: Path) -> None:
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()


CONFIG_BREAKS = {
    "corrupt JSON": (lambda f: (f / "config.json").write_text('{"hidden_size": 5'), "config.json is not valid JSON"),
    "not UTF-8": (lambda f: (f / "config.json").write_bytes(b"\xff\xfe{}"), "config.json is not valid JSON"),
    "not an object": (lambda f: (f / "config.json").write_text("[576]"), "config.json is not a JSON object"),
    "a directory": (_config_as_directory, "config.json cannot be read (Is a directory)"),
    "no config": (lambda f: (f / "config.json").unlink(), "is not a model folder (no config.json)"),
    "missing field": (lambda f: _edit_config(f, lambda c: c.pop("hidden_size")),
                      "config.json: not a usable model config (lacks 'hidden_size')"),
    "wrong type": (lambda f: _edit_config(f, lambda c: c.update(num_hidden_layers="3")),
                   "num_layers must be a positive integer, got '3'"),
    "fractional": (lambda f: _edit_config(f, lambda c: c.update(num_hidden_layers=2.5)),
                   "num_layers must be a positive integer, got 2.5"),
    "missing draft field": (lambda f: _edit_config(f, lambda c: c["specstream_draft"].pop("vocab_top")),
                            "specstream_draft block lacks vocab_top"),
    "wrong draft type": (lambda f: _edit_config(f, lambda c: c["specstream_draft"].update(vocab_top="4096")),
                         "specstream_draft vocab_top must be int, got '4096'"),
    "bad draft kind": (lambda f: _edit_config(f, lambda c: c["specstream_draft"].update(kind="huge")),
                       "needs kind in early-exit, small"),
}


@pytest.mark.parametrize("broken", CONFIG_BREAKS)
def test_a_broken_draft_config_is_refused_before_planning(tmp_path, broken):
    """The target's plan makes room for the draft from its config.json alone: a config that cannot be read
    is refused in one line, never planned as a draft of zero bytes."""
    folder = tmp_path / "draft"
    folder.mkdir()
    shutil.copyfile(SHIPPED_DRAFT / "config.json", folder / "config.json")
    assert estimated_draft_footprint(str(folder), 4).weight_bytes > 50e6       # the valid start: 3 layers + head
    change, expected = CONFIG_BREAKS[broken]
    change(folder)
    with pytest.raises(ValueError) as err:
        estimated_draft_footprint(str(folder), 4)
    assert expected in one_line(err, folder)


def test_a_broken_draft_config_through_the_cli_is_one_error_line(tmp_path):
    folder = tmp_path / "draft"
    shutil.copytree(SHIPPED_DRAFT, folder)
    (folder / "config.json").write_text("{not json")
    done = subprocess.run([sys.executable, str(ROOT / "cli.py"), "run", "hi", "--draft", str(folder),
                           "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{folder / 'config.json'} is not valid JSON" in errors[0]


# -- distillation checkpoints -----------------------------------------------------------------------

CHECKPOINT_BREAKS = {
    "shapes": (lambda t, m: t.update({"model.head": torch.zeros(129, 64)}),
               "tensor 'head' has shape (129, 64), this draft's is (128, 64)"),
    "optimizer shapes": (lambda t, m: t.update({"optimizer.0.exp_avg": torch.zeros(3)}),
                         "optimizer exp_avg of parameter 0 has shape (3,)"),
    "fingerprint": (lambda t, m: m.update(target=json.dumps(OTHER_TARGET)), "was trained against another target"),
    "missing tensor": (lambda t, m: t.pop("model.norm"), "lacks 1 and has 0 unexpected draft tensors (first 'norm')"),
    "missing key": (lambda t, m: m.pop("state"), "lacks metadata state"),
    "truncated": (None, "(truncated)"),
}


@pytest.mark.parametrize("broken", CHECKPOINT_BREAKS)
def test_a_broken_distill_checkpoint_is_refused_in_one_line(tiny_checkpoint, tmp_path, broken):
    folder, _ = tiny_checkpoint("llama")
    trainer = tiny_trainer(folder, tmp_path)
    trainer.step()
    trainer.save_checkpoint()
    change, expected = CHECKPOINT_BREAKS[broken]
    if change is None:
        truncate(trainer.checkpoint_path)
    else:
        rewrite(trainer.checkpoint_path, change)
    with pytest.raises(ValueError) as err:
        tiny_trainer(folder, tmp_path).load_checkpoint()
    assert expected in one_line(err, trainer.checkpoint_path)

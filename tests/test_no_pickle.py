"""No pickle anywhere: no module of the project can load one (an AST scan of the installed packages), and
every file the project writes and reads back (distillation checkpoints with optimizer state, vocabulary
maps, quantize resume state) is safetensors + JSON; an older version's pickled file is refused with one
line saying how to go on."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import torch

import cli
from conftest import add_tiny_tokenizer, make_tiny_checkpoint
from offload.weights.safetensors_io import SafetensorsFile
from offload.weights.source import CheckpointSource
from quant.checkpoint import layer_path
from quant.quantize import QuantizeConfig, quantize
from spec.distill import DistillConfig, distill
from spec.distill.checkpoint import CheckpointError
from spec.distill.corpus import CorpusSequence
from spec.distill.draft_model import draft_from_target
from spec.distill.train import TrainConfig, Trainer

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("offload", "spec", "quant", "judge", "runtime", "commands", "bench", "textdata")
FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "shelve", "marshal", "joblib", "dill", "cloudpickle"}
# names that unpickle (TorchScript and torch.load archives are pickles too)
FORBIDDEN_NAMES = {"torch.load", "torch.serialization", "torch.jit.load", "pandas.read_pickle",
                   *FORBIDDEN_MODULES}


def project_files() -> list[Path]:
    return [ROOT / "cli.py"] + [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """`a.b.c` with `a` replaced by what it was imported as; None for anything but a name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def _aliases(tree: ast.AST) -> dict[str, str]:
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                            for a in node.names})
        elif isinstance(node, ast.ImportFrom):
            aliases.update({a.asname or a.name: f"{node.module or ''}.{a.name}" for a in node.names})
    return aliases


def _is_forbidden(name: str | None) -> bool:
    return name is not None and any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN_NAMES)


def pickle_uses(source: str) -> list[int]:
    """Line numbers that import a pickling module, name an unpickling function, or np.load(allow_pickle=...)."""
    tree = ast.parse(source)
    aliases, lines = _aliases(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in FORBIDDEN_MODULES for a in node.names):
            lines.add(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(_is_forbidden(f"{node.module or ''}.{a.name}")
                                                      for a in node.names):
            lines.add(node.lineno)
        elif isinstance(node, (ast.Attribute, ast.Name)) and _is_forbidden(_dotted(node, aliases)):
            lines.add(node.lineno)
        elif isinstance(node, ast.Call) and _dotted(node.func, aliases) == "numpy.load" and any(
                kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False)
                for kw in node.keywords):
            lines.add(node.lineno)
    return sorted(lines)


def test_the_scan_finds_every_way_to_unpickle():
    source = "\n".join([
        "import torch", "import numpy as np", "import pickle", "import shelve", "from marshal import loads",
        "import joblib", "import dill as d", "from cloudpickle import dumps", "from torch import load as L",
        "torch.load('x')", "L('x')", "torch.serialization.add_safe_globals([])", "np.load('x', allow_pickle=True)",
        "np.load('x')", "np.load('x', allow_pickle=False)", "torch.jit.load('x')", "import json; json.load(f)",
    ])
    assert pickle_uses(source) == [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16]


def test_no_module_can_load_a_pickle():
    found = [f"{path.relative_to(ROOT)}:{line}" for path in project_files()
             for line in pickle_uses(path.read_text())]
    assert len(project_files()) > 100 and not found, f"pickle loading in: {', '.join(found)}"


# -- distillation checkpoints ---------------------------------------------------------------------

def synthetic_corpus(vocab_size: int, count: int, seed: int) -> list[CorpusSequence]:
    """Random sequences with random teacher top-4 distributions: enough to take optimizer steps."""
    generator = torch.Generator().manual_seed(seed)
    sequences = []
    for index in range(count):
        tokens = torch.randint(0, vocab_size, (10,), generator=generator)
        topk_ids = torch.randint(0, vocab_size, (10, 4), generator=generator).int()
        logprobs = torch.randn(10, 4, generator=generator).log_softmax(-1).half()
        sequences.append(CorpusSequence(tokens, topk_ids, logprobs, 3, "random", f"p{seed}-{index}"))
    return sequences


def tiny_trainer(target_folder: Path, work_dir: Path, num_steps: int = 6) -> Trainer:
    """A one-layer draft of a tiny target over its even token ids, on a random corpus."""
    source = CheckpointSource(target_folder)
    model = draft_from_target(source, "small", 1, 0, torch.arange(0, source.config.vocab_size, 2))
    config = TrainConfig(num_steps=num_steps, batch_tokens=64, learning_rate=3e-3, warmup_steps=2, eval_every=1000,
                         use_bf16=False, checkpoint_seconds=1e9)
    vocab = source.config.vocab_size
    return Trainer(model, synthetic_corpus(vocab, 12, 0), synthetic_corpus(vocab, 4, 1), config, work_dir)


def test_a_distill_checkpoint_round_trips_without_pickle(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama")
    first = tiny_trainer(folder, tmp_path)
    for _ in range(3):
        first.step()
    first.save_checkpoint()
    assert first.checkpoint_path.name == "checkpoint.safetensors" and not list(tmp_path.glob("*.pt"))
    assert SafetensorsFile(first.checkpoint_path).metadata["format"] == "specstream-distill-checkpoint"
    resumed = tiny_trainer(folder, tmp_path)
    assert resumed.load_checkpoint() and resumed.state.step == 3
    saved, loaded = first.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"] and saved["state"].keys() == loaded["state"].keys()
    for index, state in saved["state"].items():
        assert state.keys() == loaded["state"][index].keys()
        assert all(torch.equal(value, loaded["state"][index][key]) for key, value in state.items())
    for a, b in zip(first.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)
    first.run()
    resumed.run()
    assert resumed.state.step == 6
    for a, b in zip(first.model.trainable_parameters(), resumed.model.trainable_parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name,what", [("checkpoint.pt", "training checkpoint"), ("vocab_map.pt", "vocabulary map")])
def test_a_pickled_distill_file_is_refused_in_one_line(tmp_path, capsys, name, what):
    out = tmp_path / "draft"
    (out / "training").mkdir(parents=True)
    (out / "training" / name).write_bytes(b"\x80\x04\x95 an old pickle, never opened")
    expected = (f"{out / 'training' / name} is a pickled {what} from an older specstream, and pickle is never "
                f"loaded: delete {out / 'training' / '*.pt'} and rerun `specstream distill --out {out} --resume` "
                "with the same flags to retrain from step 0 (the collected corpus is kept)")
    with pytest.raises(CheckpointError) as err:
        distill(DistillConfig(None, out, resume=True))
    assert str(err.value) == expected
    assert cli.main(["distill", "--out", str(out), "--resume"]) == 2
    stderr = capsys.readouterr().err
    assert f"error: {expected}\n" in stderr and "Traceback" not in stderr


# -- quantize resume state ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    folder, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("quant") / "dense", "llama", num_hidden_layers=2,
                                     vocab_size=64)
    return add_tiny_tokenizer(folder, 64)


def _interrupted_quantization(source: Path, out: Path) -> QuantizeConfig:
    """A run stopped after layer 0 (as a kill would stop it)."""
    config = QuantizeConfig(str(source), out, bits=3, outlier_threshold=1.0, nsamples=8, seqlen=32)

    def stop(event):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize(config, stop)
    config.resume = True
    return config


def test_quantize_resumes_from_its_safetensors_state(tiny_source, tmp_path):
    config = _interrupted_quantization(tiny_source, tmp_path / "resumed")
    state = SafetensorsFile(config.out / ".state" / "hidden.safetensors")
    assert state.metadata == {"format": "specstream-quantize-state", "version": "1", "next_layer": "1"}
    assert state.entries["hidden"].shape == (8, 32, 64) and not list(config.out.rglob("*.pt"))
    seen = []
    quantize(config, lambda event: seen.append(event["layer"]))
    assert seen == [1] and not (config.out / ".state" / "hidden.safetensors").exists()
    complete = tmp_path / "complete"
    quantize(QuantizeConfig(str(tiny_source), complete, bits=3, outlier_threshold=1.0, nsamples=8, seqlen=32))
    for index in range(2):
        assert layer_path(config.out, index).read_bytes() == layer_path(complete, index).read_bytes()


def test_a_pickled_quantize_state_is_refused(tiny_source, tmp_path):
    config = _interrupted_quantization(tiny_source, tmp_path / "old")
    state = config.out / ".state"
    shutil.move(state / "hidden.safetensors", state / "hidden.pt")
    with pytest.raises(ValueError) as err:
        quantize(config)
    assert str(err.value) == (f"{state / 'hidden.pt'} is pickled resume state from an older specstream, and pickle "
                              f"is never loaded: delete {config.out} and rerun the same `specstream quantize --out "
                              f"{config.out}` command without --resume to start over")

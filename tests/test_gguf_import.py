"""GGUF import on synthetic GGUFs written with gguf.GGUFWriter, checked against independent references:
gguf.quants dequantization plus transformers' own reverse q/k permutation, transformers' forward on the
converted folder, and transformers' own GGUF loader. Plus the streamed conversion's peak memory, in a
subprocess that cannot import accelerate, and the embedded default model end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from offload.weights import gguf_tensors
from offload.weights.gguf_import import import_gguf, open_gguf, read_tensor_plan
from offload.weights.gguf_names import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES
from offload.weights.safetensors_io import SafetensorsStreamWriter, write_safetensors
from offload.weights.tokenizer import Tokenizer
from offload.weights.source import HF_GLOBAL_NAMES, HF_LAYER_NAMES

ROOT = Path(__file__).resolve().parents[1]
MATRIX_TYPES = [Q.Q8_0, Q.Q4_K, Q.F16, Q.Q4_0, Q.Q6_K, Q.F32, Q.Q4_1]
# gguf-py cannot quantize K-quants: their blocks are random bytes with a sane fp16 scale at these offsets
KQUANT_SCALES = {Q.Q4_K: ((0, 2), 5e-5), Q.Q6_K: ((208,), 1e-5)}


@dataclass(frozen=True)
class Spec:
    arch: str = "llama"
    hidden: int = 256
    ff: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    rows: int = 0            # embedding rows; 0: one per token of the tokenizer
    tied: bool = False
    embed_type: Q = Q.Q8_0
    head_type: Q = Q.Q6_K

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _tokenizer() -> tuple[list[str], list[int], list[str]]:
    from tokenizers.pre_tokenizers import ByteLevel
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = specials + sorted(ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
    return tokens, [3] * len(specials) + [1] * (len(tokens) - len(specials)), merges


def _matrix(rng: np.random.Generator, shape: tuple[int, int], qtype: Q) -> np.ndarray:
    """[rows, cols] values, or [rows, row bytes] uint8 blocks for a quantized type."""
    if qtype in KQUANT_SCALES:
        offsets, scale = KQUANT_SCALES[qtype]
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (shape[0] * shape[1] // block_size, type_size), dtype=np.uint8)
        for at in offsets:
            d = (scale * rng.uniform(0.5, 1.5, len(blocks))).astype(np.float16)
            blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(shape[0], -1)
    values = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])
    return values.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(values, qtype)


def _tensors(spec: Spec, rows: int, rng: np.random.Generator) -> list[tuple[str, np.ndarray, Q]]:
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    vector = lambda n, base=1.0: (base + 0.2 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    out = [(GGUF_GLOBAL_NAMES["embed"], _matrix(rng, (rows, spec.hidden), spec.embed_type), spec.embed_type)]
    shapes = {"q": (q, spec.hidden), "k": (kv, spec.hidden), "v": (kv, spec.hidden), "o": (spec.hidden, q),
              "gate": (spec.ff, spec.hidden), "up": (spec.ff, spec.hidden), "down": (spec.hidden, spec.ff)}
    vectors = {"input_norm": spec.hidden, "post_norm": spec.hidden}
    if spec.arch == "qwen2":
        vectors.update(q_bias=q, k_bias=kv, v_bias=kv)
    if spec.arch == "qwen3":
        vectors.update(q_norm=spec.head_dim, k_norm=spec.head_dim)
    for i in range(spec.layers):
        for j, (name, shape) in enumerate(shapes.items()):
            qtype = MATRIX_TYPES[(i + j) % len(MATRIX_TYPES)]
            out.append((f"blk.{i}.{GGUF_LAYER_NAMES[name]}", _matrix(rng, shape, qtype), qtype))
        for name, size in vectors.items():
            out.append((f"blk.{i}.{GGUF_LAYER_NAMES[name]}", vector(size, 0.0 if "bias" in name else 1.0), Q.F32))
    out.append((GGUF_GLOBAL_NAMES["norm"], gguf.quants.quantize(vector(spec.hidden), Q.Q8_0), Q.Q8_0))
    if not spec.tied:
        out.append((GGUF_GLOBAL_NAMES["lm_head"], _matrix(rng, (rows, spec.hidden), spec.head_type), spec.head_type))
    out.append(("rope_freqs.weight", np.ones(spec.head_dim // 2, np.float32), Q.F32))  # read by nobody
    return out


def write_metadata(writer: gguf.GGUFWriter, *, layers: int, hidden: int, ff: int, heads: int, kv_heads: int,
                   head_dim: int, vocab: int) -> None:
    """A tiny llama-family model's hyperparameters and the tiny BPE tokenizer, as llama.cpp writes them."""
    tokens, token_types, merges = _tokenizer()
    for add, value in [(writer.add_block_count, layers), (writer.add_context_length, 256),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, ff),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_rope_dimension_count, head_dim), (writer.add_vocab_size, vocab)]:
        add(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_gguf(path: Path, spec: Spec, seed: int = 0) -> Path:
    rows = spec.rows or len(_tokenizer()[0])
    writer = gguf.GGUFWriter(str(path), spec.arch)
    writer.add_name(f"tiny {spec.arch}")
    write_metadata(writer, layers=spec.layers, hidden=spec.hidden, ff=spec.ff, heads=spec.heads,
                   kv_heads=spec.kv_heads, head_dim=spec.head_dim, vocab=rows)
    for name, data, qtype in _tensors(spec, rows, np.random.default_rng(seed)):
        writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_tensors(path: Path) -> dict[str, torch.Tensor]:
    """HF name -> fp32 tensor: gguf.quants dequantization, then transformers' own reverse permutation."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    reader = gguf.GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()
    heads = reader.get_field(f"{arch}.attention.head_count").contents()
    kv_heads = reader.get_field(f"{arch}.attention.head_count_kv").contents()
    processor = LlamaTensorProcessor({"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    hf_names = {GGUF_GLOBAL_NAMES[k]: HF_GLOBAL_NAMES[k] for k in GGUF_GLOBAL_NAMES}
    out = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if arch == "llama":
            values = processor.process(values, tensor.name).weights
        block, _, rest = tensor.name.partition(".")
        if tensor.name in hf_names:
            out[hf_names[tensor.name]] = torch.from_numpy(np.array(values, np.float32))
        elif block == "blk":
            index, _, suffix = rest.partition(".")
            canonical = {v: k for k, v in GGUF_LAYER_NAMES.items()}[suffix]
            out[f"model.layers.{index}.{HF_LAYER_NAMES[canonical]}"] = torch.from_numpy(np.array(values, np.float32))
    return out


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(folder / shard))
    assert set(tensors) == set(index["weight_map"])
    return tensors


# transformers reads no head_dim from a qwen3 GGUF and takes Qwen3Config's 128, which every Qwen3 has
CASES = {"llama": Spec(), "llama-tied": Spec(tied=True), "qwen2": Spec(arch="qwen2"),
         "qwen3": Spec(arch="qwen3", heads=2, kv_heads=1)}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {case: write_gguf(folder / f"{case}.gguf", spec) for case, spec in CASES.items()}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("case", list(CASES))
def test_weights_match_independent_reference(synthetic, cache, monkeypatch, case):
    # tiny chunks and shards: 192 rows of a 256-wide matrix (3 of q's 4 heads) per chunk, several shards
    monkeypatch.setattr(gguf_tensors, "MAX_CHUNK_BYTES", 192 * 256 * 4)
    monkeypatch.setattr(gguf_tensors, "MAX_SHARD_BYTES", 1 << 20)
    statuses, progress = [], []
    folder = import_gguf(synthetic[case], statuses.append, lambda done, total: progress.append((done, total)))
    got, expected = read_folder(folder), reference_tensors(synthetic[case])
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    assert set(got) == set(expected) - ({"lm_head.weight"} if CASES[case].tied else set())
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is CASES[case].tied and config["dtype"] == "float32"
    assert statuses == [f"converting {case}.gguf to safetensors (fp32, once) in {folder}"]
    assert progress == [(i + 1, len(got)) for i in range(len(got))]
    assert json.loads((folder / "import.json").read_text())["skipped_tensors"] == ["rope_freqs.weight"]
    assert import_gguf(synthetic[case], statuses.append) == folder and len(statuses) == 1  # cached


@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_transformers(synthetic, cache, case):
    transformers = pytest.importorskip("transformers")
    from offload import LoadOptions, load_model
    ours = load_model(LoadOptions(model=str(synthetic[case]), device="cpu", dtype="fp32", gguf_import=True))
    reference = transformers.AutoModelForCausalLM.from_pretrained(ours.path, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    ids = torch.randint(0, ours.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
    got = ours.model.forward(ids, ours.model.new_cache(24)).logits
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert ours.tokenizer.encode("the") == transformers.AutoTokenizer.from_pretrained(ours.path).encode("the")


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_matches_transformers_gguf_loader(synthetic, cache, case):
    pytest.importorskip("accelerate")  # transformers' GGUF model loading needs it; ours does not
    transformers = pytest.importorskip("transformers")
    path = synthetic[case]
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    expected = _saved_state(model)
    got = read_folder(import_gguf(path))
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


def _saved_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as a checkpoint holds it: a tied lm_head is the embedding, not a tensor."""
    tied = model.config.tie_word_embeddings
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


def test_the_header_reads_special_tokens_as_gguf_reader_does(synthetic):
    """In place, the first start reads the special tokens from the runtime's own header parse (only the
    strings it needs); they equal what gguf's reader gives, on the default model and on synthetic files."""
    from offload.weights.gguf_header import CorruptGgufError, read_header
    from offload.weights.gguf_import import header_special_tokens, special_tokens
    from offload.weights.resolve import default_model_gguf
    for path in [default_model_gguf(), *synthetic.values()]:
        reader = open_gguf(path)
        header = read_header(path)
        assert header_special_tokens(header) == special_tokens(reader, path) != {}
        tokens = reader.get_field("tokenizer.ggml.tokens").contents()
        picks = [len(tokens) - 1, 0, len(tokens) // 2, 0]
        assert header.strings_at("tokenizer.ggml.tokens", picks) == {i: tokens[i] for i in picks}
        with pytest.raises(CorruptGgufError, match="strings"):
            header.strings_at("tokenizer.ggml.tokens", [len(tokens)])


def test_config_and_tokenizer_come_from_one_parse_of_the_file(synthetic, cache, monkeypatch):
    """transformers reads the whole GGUF for the config and again for the tokenizer; the metadata writer
    lets it parse once (seconds saved on a first start) and leaves transformers as it found it."""
    import transformers.modeling_gguf_pytorch_utils as module
    from offload.weights.gguf_model import gguf_model_folder
    original, calls = module.load_gguf_checkpoint, []

    def counted(path, *args, **kwargs):
        calls.append(str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(module, "load_gguf_checkpoint", counted)
    folder = gguf_model_folder(synthetic[next(iter(CASES))])
    assert len(calls) == 1 and module.load_gguf_checkpoint is counted
    assert json.loads((folder / "config.json").read_text())["bos_token_id"] == 1
    assert Tokenizer(folder).special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def test_special_tokens_come_from_the_gguf_metadata_not_transformers_reader(synthetic, cache, monkeypatch):
    """transformers 5.17's GGUF tokenizer reader made the bos the eos (seen on the default model); the
    import must write the ids and texts the file names, whatever the installed transformers does."""
    import transformers
    load = transformers.AutoTokenizer.from_pretrained

    def like_5_17(*args, **kwargs):  # its llama reader names the bos as eos, its qwen2 one invents unk and pad
        tokenizer = load(*args, **kwargs)
        tokenizer.eos_token = "<|im_start|>"
        tokenizer.unk_token = tokenizer.pad_token = "<|endoftext|>"
        tokenizer.clean_up_tokenization_spaces = True
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", like_5_17)
    folder = import_gguf(synthetic[next(iter(CASES))])  # names bos and eos only
    assert Tokenizer(folder).special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config.get("clean_up_tokenization_spaces", False) is False
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    assert json.loads((folder / "config.json").read_text())["bos_token_id"] == 1


def test_bf16_above_the_parameter_threshold(synthetic, cache, monkeypatch):
    monkeypatch.setattr(gguf_tensors, "MAX_FP32_PARAMS", 1000)
    statuses = []
    folder = import_gguf(synthetic["llama"], statuses.append)
    assert "(bf16, once)" in statuses[0]
    expected = reference_tensors(synthetic["llama"])
    for name, tensor in read_folder(folder).items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].to(torch.bfloat16)), name
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"


def _header_only_gguf(path: Path, arch: str, fill) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    fill(writer)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return path


def test_unsupported_files_are_refused_by_name(tmp_path, cache):
    other = _header_only_gguf(tmp_path / "other.gguf", "gpt2",
                              lambda w: w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32)))
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        import_gguf(other)
    part = _header_only_gguf(tmp_path / "part.gguf", "llama", lambda w: w.add_uint16("split.count", 3))
    with pytest.raises(ValueError, match="3-file split GGUF"):
        import_gguf(part)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        import_gguf(tmp_path / "junk.gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tensor_names_agree_with_gguf_tables(arch):
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), 1)
    pairs = [(GGUF_GLOBAL_NAMES[k], HF_GLOBAL_NAMES[k]) for k in GGUF_GLOBAL_NAMES]
    pairs += [(f"blk.0.{GGUF_LAYER_NAMES[k]}", f"model.layers.0.{HF_LAYER_NAMES[k]}") for k in GGUF_LAYER_NAMES]
    for gguf_name, hf_name in pairs:
        base, suffix = hf_name.rsplit(".", 1)
        if arch != "qwen3" and "_norm" in gguf_name and "attn_" in gguf_name:
            continue  # q/k norms exist in qwen3 only
        assert name_map.get_name(base) + "." + suffix == gguf_name, hf_name


def test_stream_writer_writes_what_write_safetensors_writes(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "empty": torch.zeros(0, 4),
               "c": torch.randn(6, 2).to(torch.bfloat16)}
    write_safetensors(tmp_path / "whole.safetensors", tensors, {"format": "pt"})
    specs = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    with SafetensorsStreamWriter(tmp_path / "streamed.safetensors", specs, {"format": "pt"}) as writer:
        for tensor in tensors.values():
            for piece in tensor.split(2):
                writer.append(piece)
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    with pytest.raises(ValueError, match="declared torch.float32"):
        with SafetensorsStreamWriter(tmp_path / "bad.safetensors", specs) as writer:
            writer.append(torch.zeros(3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="was not fully written"):
        with SafetensorsStreamWriter(tmp_path / "bad.safetensors", specs) as writer:
            writer.append(tensors["a"])
    assert not list(tmp_path.glob("bad.safetensors*"))


MEMORY_PROBE = """
import sys
sys.modules["accelerate"] = None  # the conversion must not need accelerate
import json
from pathlib import Path
from offload.weights.gguf_import import import_gguf, open_gguf, read_tensor_plan

def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

import_gguf(sys.argv[1])  # warm-up on a tiny file: lazy imports, tokenizer and config machinery
Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
baseline = status("VmRSS")
import_gguf(sys.argv[2])
print(json.dumps({"baseline": baseline, "peak": status("VmHWM")}))
"""


def test_peak_memory_stays_near_one_chunk(tmp_path, synthetic, monkeypatch):
    """~140M parameters (560 MiB in fp32, largest tensor 256 MiB) converted by a process whose peak RSS
    may grow by three dequantized chunks plus 64 MiB, well under half the model."""
    spec = Spec(hidden=512, ff=1536, layers=4, heads=8, kv_heads=2, rows=131072, embed_type=Q.F16,
                head_type=Q.Q4_0)
    big = write_gguf(tmp_path / "big.gguf", spec)
    jobs, _ = read_tensor_plan(open_gguf(big), big)
    total = sum(job.numel for job in jobs) * 4
    largest = max(job.numel for job in jobs) * 4
    bound = 3 * min(largest, gguf_tensors.MAX_CHUNK_BYTES) + (64 << 20)
    assert bound < total / 2 and bound < 3 * largest
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to measure peak RSS")
    env = {**os.environ, "SPECSTREAM_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(synthetic["llama"]), str(big)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    growth = measured["peak"] - measured["baseline"]
    print(f"peak RSS growth {growth / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB, "
          f"model {total / 2**20:.0f} MiB fp32, largest tensor {largest / 2**20:.0f} MiB")
    assert growth < bound


@pytest.fixture(scope="module")
def default_import(tmp_path_factory) -> tuple[Path, Path]:
    """(the embedded default model's GGUF, its import into a fresh cache)."""
    from offload.weights.resolve import default_model_gguf
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECSTREAM_CACHE", str(tmp_path_factory.mktemp("cache")))
        path = default_model_gguf()
        return path, import_gguf(path)


@pytest.mark.e2e
def test_default_model_shares_the_shipped_drafts_tokenizer(default_import):
    """With any transformers (under 5.17 its eos was '<|im_start|>' and every command refused the draft):
    the special tokens and chat template the GGUF names, and the tokenizer the shipped draft was built on."""
    from spec.draft import default_draft_for
    from spec.tokenizer_match import check_tokenizers_match
    path, folder = default_import
    check_tokenizers_match(folder, default_draft_for(None))
    tokenizer = Tokenizer(folder)
    assert tokenizer.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    assert tokenizer.chat_template == gguf.GGUFReader(path).get_field("tokenizer.chat_template").contents()


@pytest.mark.e2e
def test_default_model_matches_transformers_gguf_loading(default_import):
    pytest.importorskip("accelerate")  # transformers' GGUF model loading needs it; ours does not
    transformers = pytest.importorskip("transformers")
    path, folder = default_import
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    expected = _saved_state(model)
    got = read_folder(folder)
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2

"""spec/distill: batched generation, the draft folder, the sparse KL loss, resume, tokenizer checks and
bench_draft, on tiny random targets with a tiny word-level tokenizer (nothing is downloaded)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as FastTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from offload import LoadOptions, load_model
from spec import DecodeConfig, Decoder, SamplingConfig
from bench.draft_bench import DraftBenchConfig, bench_draft
from spec.distill import AnswerCache, load_draft_module
from spec.draft import default_draft_for, load_draft
from spec.draft_folder import DraftInfo, DraftFormatError, dequantize_int8, embedding_fingerprint, is_draft_folder, read_draft_info
from spec.tokenizer_match import check_tokenizers_match
from bench.draft_bench import expected_speedup, rank_counts
from spec.distill.corpus import append_shard, load_corpus
from spec.distill.draft_io import quantize_int8, save_draft
from spec.distill.draft_model import choose_vocab, draft_from_target
from spec.vocab_map import out_of_set_rows
from spec.distill.generate import NO_TARGET, GenerationConfig, generate_batch
from spec.distill.loss import sparse_kl_loss
from spec.distill.prompts import prompts_from_jsonl
from spec.distill.train import TrainConfig, Trainer
from offload.weights.source import CheckpointSource

from conftest import make_tiny_checkpoint

VOCAB = 256
SPECIALS = ["<unk>", "<s>", "</s>"]
TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}{% if add_generation_prompt %}<s> {% endif %}"


def _write_tokenizer(folder: Path, rename: dict[str, str] | None = None, eos: str = "</s>") -> None:
    words = SPECIALS + [f"w{i}" for i in range(len(SPECIALS), VOCAB)]
    words = [(rename or {}).get(w, w) for w in words]
    fast = FastTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    fast.pre_tokenizer = Whitespace()
    fast.add_special_tokens(SPECIALS)
    fast.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": eos, "unk_token": "<unk>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=3, bos_token_id=1, num_hidden_layers=3,
                                     eos_token_id=2)
    _write_tokenizer(folder)
    return load_model(LoadOptions(str(folder), device="cpu", dtype="fp32"))


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(n),), generator=generator).tolist()
            for n in torch.randint(3, 12, (count,), generator=generator)]


@pytest.fixture(scope="module")
def corpus(target, tmp_path_factory):
    """Greedy answers of the tiny target to 24 random prompts, stored as a corpus."""
    folder = tmp_path_factory.mktemp("corpus")
    config = GenerationConfig(batch_size=8, max_new_tokens=24, top_k=8, prefill_chunk=4)
    for start in range(0, 24, 8):
        sequences = generate_batch(target.model, _prompts(8, start), target.stop_ids, config)
        records = [{"id": f"p{start + i}", "source": "random"} for i in range(8)]
        # answers may hold characters str.splitlines() breaks on; records must survive them
        append_shard(folder, "greedy", records, sequences, ["line\u2028sep\x85nel" for _ in sequences])
    return load_corpus(folder)


def _draft(target, vocab_top: int = 128, num_layers: int = 1):
    source = CheckpointSource(target.path, target.config)
    counts = torch.arange(VOCAB, 0, -1)     # low ids most frequent: the kept set is 0..vocab_top-1
    vocab_map = choose_vocab(counts, vocab_top, target.stop_ids)
    return draft_from_target(source, "small", num_layers, 0, vocab_map), source


def _save(target, model, folder: Path, source) -> Path:
    info = DraftInfo("small", 0, model.vocab_top, str(target.path), embedding_fingerprint(source.global_tensors()["embed"]))
    save_draft(folder, model, info, target.path)
    return folder


def test_batched_left_padded_generation_matches_one_by_one(target):
    prompts = _prompts(5, seed=7)
    config = GenerationConfig(batch_size=5, max_new_tokens=12, top_k=4, prefill_chunk=3)
    batched = generate_batch(target.model, prompts, set(), config)
    decoder = Decoder(target.model, set(), DecodeConfig(12, 64))
    for prompt, seq in zip(prompts, batched):
        decoder.reset()
        assert seq.answer_ids == decoder.generate(prompt, SamplingConfig()).token_ids
        # the stored top-1 after each token is the next token of the greedy answer
        assert seq.topk_ids[len(prompt) - 1:-1, 0].tolist() == seq.answer_ids
        assert seq.topk_ids[-1, 0] == NO_TARGET and len(seq.topk_ids) == len(seq.token_ids)


def test_draft_folder_round_trip(target, tmp_path):
    model, source = _draft(target, num_layers=2)
    folder = _save(target, model, tmp_path / "draft", source)
    assert is_draft_folder(folder) and not is_draft_folder(target.path)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["specstream_draft"]["format"] == "specstream-draft" and raw["num_hidden_layers"] == 2
    reloaded = load_draft_module(folder)
    tokens = torch.tensor([_prompts(1)[0]])
    with torch.no_grad():                      # matrices stored in int8 (groups of 64), vectors in fp16
        for param in model.parameters():
            if param.dim() == 2:
                quantized, scale = quantize_int8(param)
                restored = dequantize_int8(quantized, scale)
                assert (restored - param).abs().max() <= scale.float().max() / 2 + 1e-6
                param.copy_(restored)
            else:
                param.copy_(param.half().float())
    assert torch.allclose(reloaded(tokens), model(tokens), atol=1e-5)
    loaded = load_draft(LoadOptions(str(folder), device="cpu", dtype="fp32"))
    cache = loaded.model.new_cache(32)
    trimmed = loaded.model.forward_trimmed(tokens, cache).logits
    assert torch.allclose(trimmed, reloaded(tokens), atol=1e-4)


def test_out_of_set_tokens_get_zero_probability(target, tmp_path):
    model, source = _draft(target, vocab_top=40)
    loaded = load_draft(LoadOptions(str(_save(target, model, tmp_path / "d", source)), device="cpu", dtype="fp32"))
    probs = loaded.model.forward(torch.tensor([[5, 6, 7]]), loaded.model.new_cache(8)).logits.softmax(-1)
    assert probs.shape[-1] == VOCAB
    in_set = torch.zeros(VOCAB, dtype=torch.bool)
    in_set[loaded.model.vocab_map] = True
    assert torch.all(probs[..., ~in_set] == 0) and torch.allclose(probs.sum(-1), torch.ones(1, 3))
    assert in_set[2] and in_set[:40].all() and not in_set[40:].any()   # the stop token is always kept
    greedy = Decoder(loaded.model, loaded.stop_ids, DecodeConfig(6, 32)).generate([5, 6], SamplingConfig())
    assert all(in_set[t] for t in greedy.token_ids)


def test_draft_needs_its_own_target(target, tmp_path):
    model, source = _draft(target)
    folder = _save(target, model, tmp_path / "d", source)
    other, _ = make_tiny_checkpoint(tmp_path / "other", "llama", seed=9)
    with pytest.raises(DraftFormatError, match="embedding differs"):
        load_draft_module(folder, target_folder=other)


def test_sparse_kl_is_zero_for_the_teacher_and_skips_out_of_set():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])                 # [1, 1, K=4]
    vocab_map = torch.tensor([10, 11, 12, 13])
    row_of = out_of_set_rows(vocab_map, 20)
    teacher = logits.log_softmax(-1)
    ids = torch.tensor([[[10, 11, 12, 13]]], dtype=torch.int32)
    out = sparse_kl_loss(logits, ids, teacher.half(), row_of, torch.ones(1, 1, dtype=torch.bool))
    assert abs(float(out.loss)) < 1e-3 and out.num_agree == 1
    # the teacher's top-1 (id 5) is out of set: renormalised over the in-set rest, no agreement
    ids = torch.tensor([[[5, 11, 12, 13]]], dtype=torch.int32)
    out = sparse_kl_loss(logits, ids, teacher.half(), row_of, torch.ones(1, 1, dtype=torch.bool))
    assert out.num_agree == 0 and out.num_top1_in_set == 0 and float(out.loss) > 0


def _trainer(target, corpus, work: Path, num_steps: int) -> Trainer:
    model, _ = _draft(target, vocab_top=VOCAB)
    config = TrainConfig(num_steps=num_steps, batch_tokens=256, learning_rate=3e-3, warmup_steps=2,
                         eval_every=1000, use_bf16=False, checkpoint_seconds=1e9)
    return Trainer(model, corpus[:20], corpus[20:], config, work)


def test_kl_loss_decreases(target, corpus, tmp_path):
    trainer = _trainer(target, corpus, tmp_path, 30)
    losses = [trainer.step()["loss"] for _ in range(30)]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert trainer.evaluate()["num_tokens"] > 0


def test_resume_continues_from_checkpoint(target, corpus, tmp_path):
    straight = _trainer(target, corpus, tmp_path / "a", 8)
    straight.run()
    first = _trainer(target, corpus, tmp_path / "b", 8)
    for _ in range(4):
        first.step()
    first.save_checkpoint()
    resumed = _trainer(target, corpus, tmp_path / "b", 8)
    assert resumed.load_checkpoint() and resumed.state.step == 4
    resumed.run()
    assert resumed.state.step == 8
    for a, b in zip(straight.model.trainable_parameters(), resumed.model.trainable_parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_revocab_keeps_trained_rows_and_starts_new_ones_from_the_target(target, corpus, tmp_path):
    from spec.distill.checkpoint import read_checkpoint
    from spec.distill.revocab import revocab_checkpoint
    config = TrainConfig(num_steps=3, batch_tokens=256, learning_rate=3e-3, warmup_steps=1, eval_every=1000,
                         use_bf16=False, checkpoint_seconds=1e9)
    old, _ = _draft(target, vocab_top=64)                               # rows: target ids 0..63
    trainer = Trainer(old, corpus[:20], corpus[20:], config, tmp_path)
    trainer.run()
    new_map = torch.cat([old.vocab_map[:40], torch.arange(100, 124)])   # 40 kept, 24 new
    source = CheckpointSource(target.path, target.config)
    new = draft_from_target(source, "small", 1, 0, new_map)
    assert revocab_checkpoint(trainer.checkpoint_path, new, old.vocab_map, new_map) == 40
    payload = read_checkpoint(trainer.checkpoint_path)
    head, bias = payload["model"]["head"], payload["model"]["head_bias"]
    assert torch.equal(head[:40], old.head.detach()[:40]) and torch.equal(bias[:40], old.head_bias.detach()[:40])
    assert torch.equal(head[40:], new.head.detach()[40:])              # the target's rows, untrained
    assert not torch.equal(old.head.detach()[:40], new.head.detach()[:40])  # training had moved the kept rows
    head_index = next(i for i, p in enumerate(new.trainable_parameters()) if p is new.head)
    moments = payload["optimizer"]["state"][head_index]["exp_avg"]
    assert moments[40:].abs().sum() == 0 and moments[:40].abs().sum() > 0
    assert revocab_checkpoint(trainer.checkpoint_path, new, old.vocab_map, new_map) == 64   # already done
    resumed = Trainer(new, corpus[:20], corpus[20:], replace(config, num_steps=5), tmp_path)
    assert resumed.load_checkpoint() and torch.equal(new.head.detach()[:40], old.head.detach()[:40])
    assert resumed.run().step == 5


def test_tokenizer_mismatch_is_refused(target, tmp_path):
    model, source = _draft(target)
    folder = _save(target, model, tmp_path / "d", source)
    check_tokenizers_match(target.path, folder)
    _write_tokenizer(folder, rename={"w7": "seven"})
    with pytest.raises(ValueError, match="token 'w7'"):
        check_tokenizers_match(target.path, folder)
    _write_tokenizer(folder, eos="<unk>")
    with pytest.raises(ValueError, match="eos_token"):
        check_tokenizers_match(target.path, folder)


def test_a_copied_tokenizer_is_parsed_once_and_a_changed_one_anew(target, tmp_path):
    from offload.weights.tokenizer import Tokenizer
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).write_bytes((target.path / name).read_bytes())
    check_tokenizers_match(target.path, copy)              # identical files: accepted without parsing
    first, second = Tokenizer(target.path), Tokenizer(copy)
    assert first._fast is second._fast
    _write_tokenizer(copy, rename={"w7": "seven"})
    changed = Tokenizer(copy)
    assert changed._fast is not first._fast and changed.token_id("seven") == 7 and first.token_id("seven") is None
    with pytest.raises(ValueError, match="token 'w7'"):
        check_tokenizers_match(target.path, copy)


def test_rank_counts_hand_computed():
    vocab_map = torch.tensor([3, 5, 7, 9])                       # draft rows -> target ids
    row_of = out_of_set_rows(vocab_map, 12)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0],                # target 3 -> row 0: rank 1
                           [4.0, 3.0, 2.0, 1.0],                # target 7 -> row 2: rank 3
                           [0.0, 5.0, 1.0, 2.0],                # target 5 -> row 1: rank 1
                           [0.0, 5.0, 1.0, 2.0]])               # target 4: out of set, no rank
    counts = rank_counts(logits, torch.tensor([3, 7, 5, 4]), row_of)
    assert counts.tolist() == [2, 0, 1, 0, 0, 0, 0, 0]
    assert expected_speedup(0.0, 0.1, 8) == (1.0, 0)
    value, chain = expected_speedup(0.8, 0.1, 16)
    assert chain > 1 and value > 2


def test_bench_draft_agreement(target, tmp_path):
    prompts = [[{"role": "user", "content": " ".join(f"w{i}" for i in ids)}] for ids in _prompts(4, 5)]
    config = DraftBenchConfig(max_new_tokens=10, batch_size=2, num_cost_steps=2, num_cost_repeats=1)
    report = bench_draft(target, target, prompts, config)          # the target drafting for itself
    assert report["top1_agreement"] == 1.0 and report["rank_acceptance"]["2"] == 0.0
    assert report["num_answer_tokens"] > 0 and report["cost_ratio"] > 0
    model, source = _draft(target, vocab_top=64)
    draft = load_draft(LoadOptions(str(_save(target, model, tmp_path / "d", source)), device="cpu", dtype="fp32"))
    report = bench_draft(target, draft, prompts, config)
    assert 0 <= report["top1_agreement"] <= report["topk_coverage"]["8"] <= report["vocab_coverage"] <= 1


def test_draft_in_bf16_matches_fp32_and_bench_reports_both_costs(target, tmp_path):
    model, source = _draft(target, vocab_top=64)
    folder = str(_save(target, model, tmp_path / "d", source))
    fp32 = load_draft(LoadOptions(folder, device="cpu", dtype="fp32"))
    bf16 = load_draft(LoadOptions(folder, device="cpu", dtype="bf16"))
    assert bf16.model.dtype == torch.bfloat16 and bf16.model.new_cache(4).keys.dtype == torch.bfloat16
    tokens = torch.tensor([_prompts(1)[0]])
    exact = fp32.model.forward_trimmed(tokens, fp32.model.new_cache(32)).logits
    approx = bf16.model.forward_trimmed(tokens, bf16.model.new_cache(32)).logits
    assert approx.dtype == torch.float32 and (approx - exact).abs().max() < 0.05 * exact.abs().max()
    shared = load_draft(LoadOptions(folder, device="cpu", dtype="bf16"), embed=fp32.model.embed)
    assert shared.model.embed is fp32.model.embed                   # the target's table, not a bf16 copy
    assert torch.equal(shared.model.forward_trimmed(tokens, shared.model.new_cache(32)).logits, approx)
    prompts = [[{"role": "user", "content": "w1 w2 w3"}]]
    config = DraftBenchConfig(max_new_tokens=4, batch_size=1, num_cost_steps=2, num_cost_repeats=1)
    report = bench_draft(target, bf16, prompts, config, draft_at_target_dtype=fp32)
    assert report["draft_dtype"] == "bf16" and report["target_dtype"] == "fp32"
    assert report["cost_ratio"] > 0 and report["cost_ratio_at_target_dtype"] > 0


def test_bench_answers_cache_is_reused_only_for_the_same_target_and_length(target, tmp_path, monkeypatch):
    import bench.draft_bench as bench_module
    prompts = [[{"role": "user", "content": " ".join(f"w{i}" for i in ids)}] for ids in _prompts(3, 4)]
    config = DraftBenchConfig(max_new_tokens=8, batch_size=2, num_cost_steps=2, num_cost_repeats=1)
    model, source = _draft(target, vocab_top=64)
    draft = load_draft(LoadOptions(str(_save(target, model, tmp_path / "d", source)), device="cpu", dtype="fp32"))
    path = tmp_path / "answers.jsonl"
    first = bench_draft(target, draft, prompts, config, cache=AnswerCache(path, target.path, 8))
    assert len(path.read_text().splitlines()) == 3
    generate = bench_module.generate_batch
    monkeypatch.setattr(bench_module, "generate_batch", lambda *a, **k: pytest.fail("cached answers regenerated"))
    second = bench_draft(target, draft, prompts, config, cache=AnswerCache(path, target.path, 8))
    assert second["top1_agreement"] == first["top1_agreement"]
    assert second["rank_acceptance"] == first["rank_acceptance"]
    monkeypatch.setattr(bench_module, "generate_batch", generate)
    shorter = DraftBenchConfig(max_new_tokens=4, batch_size=2, num_cost_steps=2, num_cost_repeats=1)
    bench_draft(target, draft, prompts, shorter, cache=AnswerCache(path, target.path, 4))
    assert len(path.read_text().splitlines()) == 6                 # another length: answered again
    path.write_text('{"not": "a record"}\n')
    with pytest.raises(ValueError, match="line 1: not an answer-cache record"):
        AnswerCache(path, target.path, 8)


def test_evaluation_files_are_refused(tmp_path):
    path = tmp_path / "prompts" / "chat.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match="evaluation data"):
        prompts_from_jsonl(path)
    assert len(prompts_from_jsonl(path, is_evaluation=True)) == 1


def test_distill_end_to_end_and_resume(target, tmp_path):
    from spec.distill import DistillConfig, distill
    generation = GenerationConfig(batch_size=4, max_new_tokens=6, max_prompt_tokens=200, top_k=4, prefill_chunk=64)
    config = DistillConfig(str(target.path), tmp_path / "draft", num_layers=1, vocab_top=64, num_steps=3,
                           batch_tokens=256, num_self_prompts=3, max_gsm8k_prompts=3, max_prompts=8,
                           num_sampled_prompts=2, generation=generation, device="cpu", dtype="fp32")
    events = []
    summary = distill(config, events.append)
    assert summary["steps"] == 3 and is_draft_folder(config.out_dir)
    assert {"self_prompts", "generate", "train"} <= {e["phase"] for e in events}
    sources = {seq.source for seq in load_corpus(config.work_dir / "corpus")}
    assert {"seed_tasks", "self_written", "gsm8k_train"} <= sources
    assert any(source.startswith("template_") for source in sources)
    with pytest.raises(ValueError, match="--resume"):
        distill(config)
    config.resume, config.num_steps = True, 5
    assert distill(config)["steps"] == 5
    config.revocab, config.num_steps = True, 6          # same corpus: the same vocabulary comes back
    assert distill(config)["steps"] == 6
    with pytest.raises(ValueError, match="add --resume"):
        DistillConfig(str(target.path), tmp_path / "other", resume=False, revocab=True)
    draft = load_draft(LoadOptions(str(config.out_dir), device="cpu", dtype="fp32"))
    check_tokenizers_match(target.path, draft.path)


def test_default_target_resolves_to_the_shipped_draft():
    folder = default_draft_for(None)
    assert folder is not None and default_draft_for("default") == folder and default_draft_for("x/y") is None
    info = read_draft_info(folder)
    assert info.target == "default" and info.kind in ("small", "early-exit")
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 25_000_000


def test_init_draft_widens_the_vocabulary_and_head_only_trains_only_the_head(target, corpus, tmp_path):
    from spec.distill import DistillConfig, distill
    from spec.distill.draft_model import DraftModel
    from spec.distill.init_draft import draft_from_draft, widened_vocab
    old, source = _draft(target, vocab_top=64)
    Trainer(old, corpus[:20], corpus[20:], TrainConfig(num_steps=3, batch_tokens=256, learning_rate=3e-3, warmup_steps=1,
                                                       eval_every=1000, use_bf16=False), tmp_path / "w").run()
    start = _save(target, old, tmp_path / "start", source)
    stored = load_draft_module(start, embed=old.embed)
    counts = torch.zeros(VOCAB, dtype=torch.long)
    counts[200:230] = torch.arange(30, 0, -1)
    wide = widened_vocab(counts, stored.vocab_map, 80, set(target.stop_ids))
    assert set(stored.vocab_map.tolist()) < set(wide.tolist()) and wide.numel() == 80
    grown = draft_from_draft(start, source, wide)
    rows = out_of_set_rows(stored.vocab_map, VOCAB)[wide]
    assert torch.equal(grown.head.detach()[rows >= 0], stored.head.detach()[rows[rows >= 0]])
    target_head = source.global_tensors().get("lm_head", source.global_tensors()["embed"]).float()
    assert torch.equal(grown.head.detach()[rows < 0], target_head[wide[rows < 0]])
    generation = GenerationConfig(batch_size=4, max_new_tokens=6, max_prompt_tokens=200, top_k=4, prefill_chunk=64)
    config = DistillConfig(str(target.path), tmp_path / "wide", vocab_top=100, num_steps=3, batch_tokens=256,
                           num_self_prompts=0, max_gsm8k_prompts=3, max_prompts=8, num_sampled_prompts=0,
                           generation=generation, device="cpu", dtype="fp32", init_draft=start, head_only=True,
                           learning_rate=0.5)
    distill(config)
    result = load_draft_module(config.out_dir, embed=old.embed)
    assert set(stored.vocab_map.tolist()) <= set(result.vocab_map.tolist())
    assert result.vocab_top > stored.vocab_top
    for before, after in zip(stored.layers, result.layers):        # the body did not train
        for name in before.weights:
            assert torch.allclose(before.weights[name], after.weights[name], atol=1e-6)
    kept = out_of_set_rows(result.vocab_map, VOCAB)[stored.vocab_map]
    assert not torch.allclose(result.head.detach()[kept], stored.head.detach(), atol=1e-3)   # the head did
    assert read_draft_info(config.out_dir).training["init_draft"] == "start"
    config.resume, config.head_only, config.num_steps = True, False, 4
    with pytest.raises(ValueError, match="same --head-only"):
        distill(config)
    with pytest.raises(ValueError, match="--init-draft"):
        DistillConfig(str(target.path), tmp_path / "x", head_only=True)
    assert isinstance(grown, DraftModel)


def test_bench_draft_on_another_models_answers_labels_with_the_targets_argmax(target, tmp_path):
    """answers_by: the target's tokens are its teacher-forced argmax on the other model's answers. On its
    own answers that argmax is its greedy answer again (independent of generation: one forward, no cache
    steps), so the report equals the default one; on another model's answers it is not."""
    prompts = [[{"role": "user", "content": " ".join(f"w{i}" for i in ids)}] for ids in _prompts(4, 6)]
    config = DraftBenchConfig(max_new_tokens=10, batch_size=2, num_cost_steps=2, num_cost_repeats=1)
    model, source = _draft(target, vocab_top=64)
    draft = load_draft(LoadOptions(str(_save(target, model, tmp_path / "d", source)), device="cpu", dtype="fp32"))
    own = bench_draft(target, draft, prompts, config)
    self_answered = bench_draft(target, draft, prompts, config, answers_by=target)
    assert self_answered["target_agrees_with_answers"] == 1.0
    assert self_answered["rank_acceptance"] == own["rank_acceptance"]
    other_folder, _ = make_tiny_checkpoint(tmp_path / "other", "llama", seed=11, bos_token_id=1, num_hidden_layers=3,
                                           eos_token_id=2)
    _write_tokenizer(other_folder)
    other = load_model(LoadOptions(str(other_folder), device="cpu", dtype="fp32"))
    crossed = bench_draft(target, draft, prompts, config, answers_by=other)
    assert crossed["answers_by"] == other_folder.name and crossed["target_agrees_with_answers"] < 0.5
    assert crossed["num_answer_tokens"] > 0 and 0 <= crossed["top1_agreement"] <= 1

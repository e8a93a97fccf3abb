"""AutoJudge: task checkers, the sandbox, mining against an independent greedy reference (transformers),
the classifier and its file, and the judge as a lossy acceptance policy on tiny random pairs."""
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_pair
from judge.classifier import Judge, JudgeFormatError, fit_logistic, roc_auc
from judge.mine import MineConfig, finished_problems, mine
from judge.policy import JudgePolicy, default_threshold, load_judge_for
from judge.sandbox import run_program
from judge.tasks import Gsm8k, HumanEval, Problem, extract_code, parse_number
from judge.train import read_mined, train_judge
from spec import DecodeConfig, Decoder, FixedBudget, SamplingConfig, Speculator
from trees import tree_from_parents
from spec.draft_folder import embedding_fingerprint
from spec.verify import Verdict

VOCAB, CONTEXT, HIDDEN = 48, 128, 64
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.mark.parametrize("text, number", [
    ("so 3 + 4 = 7.\n#### 7", "7"), ("The total is $1,250.", "1250"), ("#### 12.0 apples", "12"),
    ("first 3 then -4", "-4"), ("Answer: 2.5 and #### 18 (check 20)", "18"), ("no digits", None),
])
def test_gsm8k_answer_is_the_number_after_the_marker_or_the_last_one(text, number):
    assert parse_number(text) == number


def test_malformed_task_lines_are_reported_and_skipped(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text('{"question": "1+1?", "answer": "#### 2"}\nnot json\n{"question": "x"}\n'
                    '{"question": "2+2?", "answer": "so #### 4"}\n')
    skipped = []
    problems = Gsm8k().problems("test", path, on_skip=skipped.append)
    assert [p.gold for p in problems] == ["2", "4"]
    assert [s.split(":")[0] for s in skipped] == ["problems.jsonl line 2", "problems.jsonl line 3"]


def test_sandbox_passes_fails_and_contains_hangs_memory_and_network():
    assert run_program("assert sum(range(5)) == 10", 10).passed
    assert run_program("assert 1 == 2", 10).reason == "failed"
    assert run_program("while True: pass", 1).reason == "timeout"
    assert not run_program("x = bytearray(4 << 30)", 10).passed                 # over the address-space limit
    assert not run_program("import socket; socket.create_connection(('127.0.0.1', 9))", 10).passed
    assert not run_program("import os; os.kill(os.getpid(), 9)", 10).passed      # a crash is a failure, not ours


def test_humaneval_outcome_runs_the_tests_on_the_extracted_code(tmp_path, monkeypatch):
    rows = [{"task_id": f"HumanEval/{i}", "prompt": "from typing import List\n\n\ndef add(a, b):\n",
             "entry_point": "add", "test": "def check(f):\n    assert f(2, 3) == 5\n"} for i in range(2)]
    path = tmp_path / "he.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    task = HumanEval()
    monkeypatch.setattr(HumanEval, "TIMEOUT_SECONDS", 2.0)
    train, test = task.problems("train", path), task.problems("test", path)
    assert [p.id for p in train] == ["HumanEval/0"] and [p.id for p in test] == ["HumanEval/1"]
    good = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert extract_code(good).startswith("def add") and task.outcome(train[0], good) is True
    assert task.outcome(train[0], "```python\ndef add(a: List[int], b) -> List[int]:\n    return a + b\n```") is True
    assert task.outcome(train[0], "```python\ndef add(a, b):\n    return a - b\n```") is False
    assert task.outcome(train[0], "```python\ndef add(a, b):\n    while True: pass\n```") is False


def test_humaneval_is_refused_without_isolation_unless_unconfined_is_explicit(monkeypatch):
    import judge.tasks as tasks
    from judge.sandbox import IsolationReport
    monkeypatch.setattr(tasks, "available_isolation", lambda: IsolationReport((), "seccomp filter refused (test)"))
    with pytest.raises(ValueError, match="cannot sandbox it: seccomp filter refused \\(test\\); pass --unconfined-code"):
        tasks.get_task("humaneval")
    assert tasks.get_task("humaneval", unconfined=True).unconfined
    assert tasks.get_task("gsm8k").name == "gsm8k"


def test_roc_auc_equals_the_pairwise_definition():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (40,), generator=generator).float()      # many ties
    labels = torch.randint(0, 2, (40,), generator=generator)
    pairs = [(1.0 if p > n else 0.5 if p == n else 0.0) for p in scores[labels == 1] for n in scores[labels == 0]]
    assert roc_auc(scores, labels) == pytest.approx(sum(pairs) / len(pairs))
    assert math.isnan(roc_auc(scores, torch.zeros(40)))


def synthetic_records(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels from a noisy linear rule on 8 features of different scales."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(n, 8, generator=generator) * torch.arange(1, 9) + 3
    logit = 2.0 * (features[:, 0] - 3) - 0.5 * (features[:, 3] - 3) / 4
    labels = (torch.rand(n, generator=generator) < torch.sigmoid(logit)).long()
    return features, labels


def test_logistic_regression_learns_a_linear_rule():
    features, labels = synthetic_records(600, 1)
    standard = (features - features.mean(0)) / features.std(0)
    weight, bias = fit_logistic(standard, labels, l2=1e-3)
    assert weight[0] > 1.0 and abs(weight[1]) < 0.3
    assert roc_auc(standard @ weight + bias, labels) > 0.85


def write_mined(path, features, labels, problems_of):
    lines = [json.dumps({"problem": problems_of(i), "position": i, "label": int(label),
                         "features": feature.tolist()}) for i, (feature, label) in enumerate(zip(features, labels))]
    path.write_text("\n".join(lines[:5]) + "\n{torn line\n" + "\n".join(lines[5:]) + "\n")


def test_train_cross_validates_by_problem_and_saves_a_judge_that_loads_back(tmp_path):
    features, labels = synthetic_records(800, 2)
    mined = tmp_path / "mined.jsonl"
    write_mined(mined, features, labels, lambda i: f"p{i // 10}")
    skipped = []
    assert len(read_mined([mined], on_skip=skipped.append)[1]) == 800 and len(skipped) == 1
    judge, report = train_judge([mined], "fp")
    assert report["problems"] == 80 and report["folds"] == 5 and report["roc_auc"] > 0.85
    cutoffs = judge.thresholds[:, 1]
    assert (cutoffs[1:] >= cutoffs[:-1]).all() and 0 < default_threshold(judge) < 1
    judge.save(tmp_path / "j.safetensors")
    loaded = Judge.load(tmp_path / "j.safetensors")
    torch.testing.assert_close(loaded.important_probability(features), judge.important_probability(features))
    assert loaded.target_fingerprint == "fp" and loaded.roc_auc == pytest.approx(report["roc_auc"], abs=1e-4)


def constant_judge(probability: float, hidden: int = HIDDEN, fingerprint: str = "fp") -> Judge:
    bias = torch.tensor([math.log(probability / (1 - probability))])
    return Judge(torch.zeros(hidden), torch.ones(hidden), torch.zeros(hidden), bias,
                 torch.tensor([[0.5, probability]]), fingerprint, 0.5)


def test_judge_files_of_another_version_shape_or_target_are_refused(tmp_path):
    path = tmp_path / "j.safetensors"
    constant_judge(0.3).save(path)
    with pytest.raises(JudgeFormatError, match="another target"):
        load_judge_for(str(path), torch.ones(VOCAB, HIDDEN), HIDDEN)
    with pytest.raises(JudgeFormatError, match="hidden states of size 64"):
        load_judge_for(str(path), torch.ones(VOCAB, 32), 32)
    from offload.weights.safetensors_io import write_safetensors
    write_safetensors(path, {"mean": torch.zeros(2)}, {"format": "specstream-judge", "version": "9"})
    with pytest.raises(JudgeFormatError, match="version '9'"):
        Judge.load(path)
    with pytest.raises(JudgeFormatError, match="shapes"):
        Judge(torch.zeros(4), torch.ones(3), torch.zeros(4), torch.zeros(1), torch.zeros(2, 2), "fp", 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        JudgePolicy(constant_judge(0.3), 1.5)


def test_policy_accepts_a_mismatch_when_the_judge_scores_it_unimportant():
    #        0
    #      1   2        children of the root; 3 under 1, 4 under 3
    #      3
    #      4
    tree = tree_from_parents([5, 6, 7, 8, 9], [-1, 0, 0, 1, 3])
    choices = torch.tensor([6, 8, 0, 1, 0])                  # target: 6 after root, 8 after node 1, 1 after 3
    hidden = torch.zeros(5, HIDDEN)
    hidden[:, 0] = torch.tensor([-2.0, 0.0, 0.0, -3.0, 0.0])  # p(important) = sigmoid(h0): low at nodes 0, 3
    judge = Judge(torch.zeros(HIDDEN), torch.ones(HIDDEN), torch.eye(HIDDEN)[0], torch.zeros(1),
                  torch.tensor([[0.5, 0.5]]), "fp", 0.5)
    ok = JudgePolicy(judge, 0.2).accept(tree, Verdict(choices, hidden))
    # node 1 matches; node 2 mismatches under a low-p parent (accepted); node 3 matches; node 4 mismatches
    # under node 3 (sigmoid(-3) < 0.2: accepted)
    assert ok.tolist() == [True, True, True, True, True]
    ok = JudgePolicy(judge, 0.1).accept(tree, Verdict(choices, hidden))     # sigmoid(-2) = 0.12 > 0.1
    assert ok.tolist() == [True, True, False, True, True]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("judge_pair"), 3, VOCAB, 0.6, CONTEXT, 64, TEMPLATE)


def decode(target, draft, policy, budget, prompt, max_new=24, width=None):
    growth = {"max_width": width} if width else {}
    decoder = Decoder(target.model, target.stop_ids, DecodeConfig(max_new, CONTEXT, max_pass_tokens=64, **growth),
                      Speculator(draft, CONTEXT, budget, 64), FixedBudget(budget), policy)
    return decoder.generate(prompt, SamplingConfig())


def test_threshold_zero_is_lossless_and_one_accepts_whole_chains(pair):
    _, _, target, draft = pair
    prompt = [3, 9, 27, 5]
    exact = decode(target, draft, None, 8, prompt)
    strict = decode(target, draft, JudgePolicy(constant_judge(0.5), 0.0), 8, prompt)
    assert strict.token_ids == exact.token_ids and strict.stats.policy_accepted == 0
    lax = decode(target, draft, JudgePolicy(constant_judge(0.5), 1.0), 6, prompt, width=1)
    stats = lax.stats
    assert stats.policy_accepted > 0 and lax.token_ids != exact.token_ids
    assert stats.num_new_tokens - 1 == 6 * stats.num_steps or stats.num_new_tokens == 24   # whole chain + 1


class LastWord:
    """A toy task: the outcome is the response's last word."""
    name = "toy"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def outcome(self, problem, response: str):
        words = response.split()
        return words[-1] if words else None


def greedy(model, ids, count, stops):
    out = []
    while len(out) < count:
        token = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        out.append(token)
        if token in stops:
            break
    return out


def reference_walk(target_hf, draft_hf, tokenizer, prompt, task, max_new, stops):
    """The semi-greedy search written plainly on transformers' models: one record per mismatch."""
    decode_text = tokenizer.decode
    response = greedy(target_hf, prompt, max_new, stops)
    reference = task.outcome(None, decode_text(response))
    records, position = [], 0
    while True:
        sequence = prompt + response
        guesses = draft_hf(torch.tensor([sequence])).logits[0].argmax(-1).tolist()
        base = len(prompt) - 1
        found = [p for p in range(position, len(response)) if guesses[base + p] != response[p]]
        if not found:
            return records
        p = found[0]
        token = guesses[base + p]
        hidden = target_hf(torch.tensor([sequence[:base + p + 1]]), output_hidden_states=True).hidden_states[-1][0, -1]
        rest = [] if token in stops else greedy(target_hf, prompt + response[:p] + [token], max_new - p - 1, stops)
        candidate = (response[:p] + [token] + rest)[:max_new]
        label = int(task.outcome(None, decode_text(candidate)) != reference)
        records.append((p, response[p], token, label, hidden))
        if not label:
            response = candidate
        position = p + 1


@torch.inference_mode()
def test_mining_matches_the_plain_semi_greedy_search_and_resumes(pair, tmp_path):
    target_folder, draft_folder, target, draft = pair
    task = LastWord(target.tokenizer)
    problems = [Problem(f"p{i}", text, "") for i, text in enumerate(["t3 t9 t27", "t11 t2 t40 t7", "t6", "t30 t31"])]
    config = MineConfig(max_new_tokens=10, batch_size=3, max_mismatches=64)
    out = tmp_path / "mined.jsonl"
    mine(target, draft, task, problems[:2], out, config)
    assert finished_problems(out) == {"p0", "p1"}
    counts = mine(target, draft, task, problems, out, config)                 # resumes with p2, p3 only
    assert counts["problems"] == 4
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["problem"] for r in rows if r.get("done")] == ["p0", "p1", "p2", "p3"]
    target_hf = AutoModelForCausalLM.from_pretrained(target_folder, attn_implementation="eager").float().eval()
    draft_hf = AutoModelForCausalLM.from_pretrained(draft_folder, attn_implementation="eager").float().eval()
    labels = set()
    for problem in problems:
        prompt = target.tokenizer.encode_chat([{"role": "user", "content": problem.prompt}])
        expected = reference_walk(target_hf, draft_hf, target.tokenizer, prompt, task, 10, target.stop_ids)
        mined = [r for r in rows if r["problem"] == problem.id and "label" in r]
        assert [(r["position"], r["target_token"], r["draft_token"], r["label"]) for r in mined] == \
            [record[:4] for record in expected]
        for row, record in zip(mined, expected):
            torch.testing.assert_close(torch.tensor(row["features"]), record[4], atol=1e-4, rtol=0)
        labels |= {r["label"] for r in mined}
    assert len(rows) > 8 and labels == {0, 1}


def test_default_judge_is_refused_for_another_target(pair):
    from judge.policy import DEFAULT_JUDGE
    if not DEFAULT_JUDGE.is_file():
        pytest.skip("no default judge in this build")
    _, _, target, _ = pair
    with pytest.raises(JudgeFormatError):
        load_judge_for("default", target.model.embed, target.config.hidden_size)
    assert embedding_fingerprint(target.model.embed) != Judge.load(DEFAULT_JUDGE).target_fingerprint

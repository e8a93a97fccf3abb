"""Sampling with speculation is exact: on a tiny-vocabulary pair, the joint distribution of the first two
tokens that tree steps emit matches the target's own, and the same test rejects a broken acceptance rule.

Each run samples t1 at the prefill and then t2, t3 through speculative steps (trees of 6 nodes whose
children are accepted often, so t2 and t3 usually come out of one tree). For every frequent t1 the
counts of (t2, t3) are compared with n(t1) * p(t2 | t1) * p(t3 | t1, t2) from the target's own
forward; the chi-square statistics of all t1 groups are summed. Significance level: 0.001 (a correct
sampler fails this test once in a thousand seeds; the seeds are fixed, so the outcome is deterministic).
"""
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from conftest import tiny_pair
from spec import DecodeConfig, Decoder, FixedBudget, SamplingConfig, Speculator, probabilities
from spec.verify import ExactMatch, matches_target

VOCAB, RUNS, ALPHA, MIN_GROUP = 5, 2400, 1e-3, 200
FIRST_SEED = 100_000    # seeds FIRST_SEED + 0..RUNS-1. Seed ranges from 0, 100k, ..., 500k gave
# p = 0.0014, 0.74, 0.87, 0.47, 0.74, 0.42: uniform, as p is under a correct sampler
PROMPT = [3, 1, 4, 1]
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95)


class DraftFavouriteToo(ExactMatch):
    """Broken on purpose: also accepts the draft's best child of every node, as if it were a target sample."""
    is_lossless = False

    def accept(self, tree, verdict):
        ok = matches_target(tree, verdict.choices)
        first_child = torch.ones_like(ok)
        seen = set()
        for node, parent in enumerate(tree.parents.tolist()):
            first_child[node] = parent >= 0 and parent not in seen
            seen.add(parent)
        return ok | first_child


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("sampling"), 7, VOCAB, 0.3, 32, 16)[2:]


PENALIZED = replace(SAMPLING, repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.3)
# with PENALIZED, seed ranges from 100k, 0, 200k, 300k gave p = 0.022, 0.34, 0.26, 0.45


def target_distribution(target, prefix: list[int], sampling: SamplingConfig = SAMPLING) -> torch.Tensor:
    """[V] the distribution the target samples from after `prefix` (PROMPT, then the answer): the
    penalties written from their definitions (repetition over the whole prefix, as transformers' processor;
    presence and frequency over the answer's counts), then temperature and top-p."""
    cache = target.model.new_cache(32)
    logits = target.model.forward(torch.tensor([prefix]), cache, last_only=True).logits[0, -1]
    logits = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)(torch.tensor([prefix]), logits[None])[0]
    counts = torch.bincount(torch.tensor(prefix[len(PROMPT):], dtype=torch.long), minlength=VOCAB).float()
    logits = logits - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).float()
    return probabilities(logits, sampling)


def sample_runs(target, draft, policy, base: SamplingConfig = SAMPLING,
                speculator=None) -> tuple[list[list[int]], float]:
    """(t1, t2, t3) of every run, and the share of runs whose first tree yielded both t2 and t3."""
    config = DecodeConfig(3, 32, max_pass_tokens=16, max_children=3)
    decoder = Decoder(target.model, set(), config, speculator or Speculator(draft, 32, 6, 16), FixedBudget(6),
                      policy)
    runs, num_both = [], 0
    for seed in range(RUNS):
        decoder.reset()
        sampling = replace(base, seed=FIRST_SEED + seed)
        result = decoder.generate(PROMPT, sampling)
        runs.append(result.token_ids)
        num_both += result.stats.num_steps == 1
    return runs, num_both / RUNS


def chi_square_p_value(target, runs, sampling: SamplingConfig = SAMPLING) -> tuple[float, int]:
    """(p-value, degrees of freedom) of the summed chi-square over frequent t1 groups."""
    statistic, dof = 0.0, 0
    for t1 in range(VOCAB):
        group = [run[1:] for run in runs if run[0] == t1]
        if len(group) < MIN_GROUP:
            continue
        first = target_distribution(target, PROMPT + [t1], sampling)
        expected = torch.stack([first[t2] * target_distribution(target, PROMPT + [t1, t2], sampling)
                                for t2 in range(VOCAB)])
        observed = torch.zeros(VOCAB, VOCAB)
        for t2, t3 in group:
            observed[t2, t3] += 1
        expected, observed = (expected * len(group)).flatten(), observed.flatten()
        small = expected < 5                     # pooled into one cell, as the test requires
        expected = torch.cat((expected[~small], expected[small].sum()[None]))
        observed = torch.cat((observed[~small], observed[small].sum()[None]))
        keep = expected > 0
        assert (observed[~keep] == 0).all(), "a token the target never samples was emitted"
        statistic += float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        dof += int(keep.sum()) - 1
    assert dof > 0
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2))), dof


def test_speculative_sampling_matches_the_target_distribution(pair):
    target, draft = pair
    runs, one_tree_share = sample_runs(target, draft, ExactMatch())
    assert one_tree_share > 0.3          # the draft is good enough that trees, not bonus tokens, are tested
    p_value, dof = chi_square_p_value(target, runs)
    print(f"p = {p_value:.3g}, dof {dof}, one-tree share {one_tree_share:.2f}")
    assert p_value > ALPHA, (p_value, dof)


def test_speculative_sampling_with_penalties_matches_the_penalized_target(pair):
    """Repetition, presence and frequency penalties: each node's distribution is penalized over its own
    path, so t2 and t3 from one tree follow the penalized target given t1 (and t2)."""
    target, draft = pair
    runs, one_tree_share = sample_runs(target, draft, ExactMatch(), PENALIZED)
    assert one_tree_share > 0.2
    p_value, dof = chi_square_p_value(target, runs, PENALIZED)
    print(f"penalized: p = {p_value:.3g}, dof {dof}, one-tree share {one_tree_share:.2f}")
    assert p_value > ALPHA, (p_value, dof)
    assert chi_square_p_value(target, runs)[0] < ALPHA      # and they are not the unpenalized target's


def test_the_same_test_rejects_a_broken_acceptance_rule(pair):
    target, draft = pair
    runs, _ = sample_runs(target, draft, DraftFavouriteToo())
    p_value, dof = chi_square_p_value(target, runs)
    print(f"broken rule: p = {p_value:.3g}, dof {dof}")
    assert p_value < ALPHA, (p_value, dof)


def test_self_draft_sampling_matches_the_target_distribution(pair, tmp_path, monkeypatch):
    """The self-draft (2-bit substitute of the second layer, drafting in the target's own cache) samples the
    target's distribution too."""
    from spec.self_draft import SubstituteConfig, load_self_draft
    from spec.self_speculator import SelfSpeculator
    monkeypatch.setenv("SPECSTREAM_CACHE", str(tmp_path))
    target, _ = pair
    draft = load_self_draft(target, SubstituteConfig(2), layers=[1])
    runs, one_tree_share = sample_runs(target, draft, ExactMatch(), speculator=SelfSpeculator(draft, 6, priced=False))
    assert one_tree_share > 0.3
    p_value, dof = chi_square_p_value(target, runs)
    print(f"self-draft: p = {p_value:.3g}, dof {dof}, one-tree share {one_tree_share:.2f}")
    assert p_value > ALPHA, (p_value, dof)

"""Trees by hand: positions and masks from parent indices, acceptance, and growth against a brute-force
best-first search over a tiny real draft."""
import math

import pytest
import torch

from trees import tree_from_parents, tree_mask
from spec import ExactMatch, GrowthConfig, Proposal, Speculator, Tree, Verdict, accepted_path
from spec.draft import Draft
from spec.verify import matches_target
from conftest import add_tiny_tokenizer

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
TOKENS = [10, 11, 12, 13, 14, 15, 16]


def brute_force_ancestors(parents):
    size = len(parents)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for node in range(size):
        walk = node
        while walk >= 0:
            mask[node, walk] = True
            walk = parents[walk]
    return mask


def test_positions_and_masks_follow_from_parents():
    tree = tree_from_parents(TOKENS, PARENTS)
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.positions(40).tolist() == [[40, 41, 41, 42, 42, 42, 43]]
    assert torch.equal(tree.ancestor_mask(), brute_force_ancestors(PARENTS))
    full = tree.attention_mask(5)
    assert full.shape == (7, 12) and full[:, :5].all()
    assert torch.equal(full, tree_mask(torch.tensor(PARENTS), 5))      # the landed reference builder
    assert tree.path_to(6) == [0, 1, 3, 6] and tree.path_to(0) == [0]


@pytest.mark.parametrize("parents, fragment", [([0, 0], "root"), ([-1, 2, 0], "precedes"), ([-1, -1], "precedes")])
def test_malformed_trees_are_refused(parents, fragment):
    with pytest.raises(ValueError, match=fragment):
        tree_from_parents(list(range(len(parents))), parents)


def test_greedy_acceptance_takes_the_longest_matching_path():
    tree = tree_from_parents(TOKENS, PARENTS)
    # target's choice at each node: at root 11 (node 1), at 1 -> 13 (node 3), at 3 -> 16 (node 6), at 6 -> 99
    choices = torch.tensor([11, 13, 0, 16, 0, 0, 99])
    ok = ExactMatch().accept(tree, Verdict(choices, None))
    assert ok.tolist() == [True, True, False, True, False, False, True]
    assert accepted_path(tree, ok) == [0, 1, 3, 6]
    # the root's choice matches no child: nothing accepted
    assert accepted_path(tree, matches_target(tree, torch.tensor([77, 13, 0, 16, 0, 0, 0]))) == [0]
    # a deep match under a rejected parent does not count
    assert accepted_path(tree, matches_target(tree, torch.tensor([12, 13, 0, 16, 0, 0, 0]))) == [0, 2]


def test_acceptance_ties_prefer_the_earlier_node():
    tree = tree_from_parents([1, 2, 3], [-1, 0, 0])
    assert accepted_path(tree, torch.tensor([True, True, True])) == [0, 1]


# Growth against brute force -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_draft(tiny_checkpoint):
    from offload import LoadOptions, load_model
    folder, _ = tiny_checkpoint("llama", vocab_size=32)
    add_tiny_tokenizer(folder, 32)
    return Draft(load_model(LoadOptions(str(folder), device="cpu", dtype="fp32")), 32)


def sequential_logprobs(draft, prefix, path):
    """[K] draft log-probabilities after prefix + path, computed causally on a fresh cache."""
    cache = draft.model.new_cache(64)
    return draft.log_probs(torch.tensor([prefix + path]), cache, last_only=True)[-1]


def brute_force_best(draft, prefix, root, budget, children, depth):
    """The `budget` best nodes (root included) of the tree in which every node has its top `children`
    draft tokens as children: (path tuple -> cumulative log-probability)."""
    frontier, nodes = [((), 0.0)], {(): 0.0}
    for _ in range(depth):
        grown = []
        for path, logp in frontier:
            top = sequential_logprobs(draft, prefix, [root, *path]).topk(children)
            grown += [((*path, int(t)), logp + float(v)) for v, t in zip(top.values, top.indices)]
        nodes.update(grown)
        frontier = grown
    return dict(sorted(nodes.items(), key=lambda kv: -kv[1])[:budget])


def grown_paths(tree: Tree) -> dict[tuple, float]:
    out = {}
    for node in range(tree.num_nodes):
        path = tree.path_to(node)[1:]
        out[tuple(int(tree.tokens[n]) for n in path)] = float(tree.logprobs[node])
    return out


@pytest.mark.parametrize("budget, width", [(2, 1), (6, 1), (12, 1), (12, 3), (20, 4)])
def test_growth_matches_brute_force_best_first(tiny_draft, budget, width):
    prefix, root, children, depth = [3, 7, 1, 9], 5, 3, 3
    speculator = Speculator(tiny_draft, 64, budget, 64)
    [(tree, slots)] = speculator.propose([Proposal(0, prefix, root, GrowthConfig(budget, width, children, depth))])
    expected = brute_force_best(tiny_draft, prefix, root, budget, children, depth)
    got = grown_paths(tree)
    if width == 1:   # one node per round is exact best-first search
        assert set(got) == set(expected)
    assert len(got) == min(budget, len(got)) and tree.num_nodes <= budget
    for path, logp in got.items():   # every node's log-probability is the causal one: masks and positions hold
        reference = 0.0
        for i in range(len(path)):
            reference += float(sequential_logprobs(tiny_draft, prefix, [root, *path[:i]])[path[i]])
        assert math.isclose(logp, reference, abs_tol=1e-4), path
    assert torch.equal(tree.logprobs, tree.logprobs.sort(descending=True).values)   # best-first order
    for node in range(1, tree.num_nodes):            # every parent (but the root) of a node was expanded
        parent = int(tree.parents[node])
        assert parent == 0 or int(slots[parent]) >= speculator.cache.lengths[0]


def test_chain_is_the_greedy_draft_continuation(tiny_draft):
    prefix, root = [3, 7, 1, 9], 5
    [(tree, _)] = Speculator(tiny_draft, 64, 5, 64).propose([Proposal(0, prefix, root, GrowthConfig.chain(5))])
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]
    greedy, sequence = [], [root]
    for _ in range(4):
        greedy.append(int(sequential_logprobs(tiny_draft, prefix, sequence).argmax()))
        sequence.append(greedy[-1])
    assert tree.tokens[1:].tolist() == greedy


def test_budget_one_is_the_root_alone(tiny_draft):
    speculator = Speculator(tiny_draft, 16, 1, 16)
    [(tree, _)] = speculator.propose([Proposal(0, [3], 5, GrowthConfig(1))])
    assert tree.num_nodes == 1 and speculator.cache.pending[0].numel() == 0


def test_context_lookup_proposes_the_last_out_of_vocabulary_follower_of_a_bigram():
    from spec.lookup import ContextLookup
    lookup = ContextLookup(torch.tensor([1, 2, 3, 4]))              # the draft can propose 1..4 only
    lookup.sync([1, 2, 9, 3, 1, 2, 8, 4])                            # (1, 2) -> 9, later (1, 2) -> 8
    assert lookup.children([1, 2, 3], [2, 8, 4]) == [8, None, None]
    lookup.sync([1, 2, 9, 3, 1, 2, 8, 4, 2, 8, 7])                   # an extension: (2, 8) -> 7 added
    assert lookup.children([2, 1], [8, 2]) == [7, 8]
    lookup.sync([5, 6, 12])                                          # a new conversation: index rebuilt
    assert lookup.children([1, 5], [2, 6]) == [None, 12]
    lookup.sync([5, 6, 12, 5, 6, 3])                                 # in-vocabulary followers are left to the draft
    assert lookup.children([5], [6]) == [12]


def test_growth_adds_the_context_lookup_child_and_expands_it_causally(tiny_draft):
    from spec.lookup import LOOKUP_LOGPROB, ContextLookup
    prefix, root = [9, 5, 20, 3, 1, 9], 5                 # (9, 5) was followed by 20, outside the rows 0..15
    lookup = ContextLookup(torch.arange(16))
    lookup.sync(prefix + [root])
    speculator = Speculator(tiny_draft, 64, 40, 64)
    speculator.lookups[0] = lookup                        # as for a draft whose rows cover 0..15 alone
    [(tree, _)] = speculator.propose([Proposal(0, prefix, root, GrowthConfig(40, 4, 3, 3))])
    got = grown_paths(tree)
    assert math.isclose(got[(20,)], LOOKUP_LOGPROB, abs_tol=1e-6)
    under = {path: logp for path, logp in got.items() if len(path) == 2 and path[0] == 20}
    assert under, "the lookup child was expanded"
    after = sequential_logprobs(tiny_draft, prefix, [root, 20])
    for path, logp in under.items():
        assert math.isclose(logp, LOOKUP_LOGPROB + float(after[path[1]]), abs_tol=1e-4)


def test_path_tokens_list_each_nodes_tokens_up_to_the_root():
    tree = tree_from_parents([10, 11, 12, 13, 14], [-1, 0, 0, 1, 3])
    assert tree.path_tokens().tolist() == [[10, -1, -1, -1], [11, 10, -1, -1], [12, 10, -1, -1],
                                           [13, 11, 10, -1], [14, 13, 11, 10]]

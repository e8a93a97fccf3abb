"""Speculative decoding on tiny random pairs saved as ordinary model folders: greedy output is token for
token the target's own greedy output for every seed, budget, tree shape and tier; stops land where
target-only decoding stops; Ctrl-C mid-growth or mid-verification leaves both caches usable."""
import pytest
import torch

from conftest import add_tiny_tokenizer, make_tiny_checkpoint, perturbed_copy
from offload import LoadOptions, load_model
from spec import DecodeConfig, Decoder, FixedBudget, GrowthConfig, Proposal, SamplingConfig, Speculator, load_any_draft

VOCAB = 48
CONTEXT = 160


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """seed -> (target folder, close draft folder, far draft folder)."""
    made = {}

    def get(seed: int):
        if seed not in made:
            root = tmp_path_factory.mktemp(f"pair{seed}")
            target, _ = make_tiny_checkpoint(root / "target", "llama", seed=seed, vocab_size=VOCAB,
                                             num_hidden_layers=3)
            add_tiny_tokenizer(target, VOCAB)
            made[seed] = (target, perturbed_copy(target, root / "close", 0.15, seed),
                          perturbed_copy(target, root / "far", 1.0, seed))
        return made[seed]

    return get


def load_pair(target_folder, draft_folder, tier="device", device="cpu"):
    options = LoadOptions(str(target_folder), device=device, dtype="fp32", max_context=CONTEXT, max_pass_tokens=64)
    if tier != "device":
        probe = load_model(options)
        layer_bytes = probe.plan.request.layer_bytes
        fixed = sum(i.num_bytes for i in probe.plan.items if "layers" not in i.component)
        probe.layers.close()
        ring = 2 * layer_bytes                       # no layer resident: all three stream through the ring
        options.gpu_mem, options.ram = fixed + ring + layer_bytes // 2, (1 if tier == "disk" else 100 * layer_bytes)
    target = load_model(options)
    assert tier == "device" or tier in target.plan.tier_of
    draft = load_any_draft(str(draft_folder), target, LoadOptions(device=device, dtype="fp32", max_context=CONTEXT))
    return target, draft


def decode(target, draft, prompt, budget, max_new=20, growth=None, sampling=None, stop_ids=None):
    config = DecodeConfig(max_new, CONTEXT, max_pass_tokens=64, **(growth or {}))
    speculator = Speculator(draft, CONTEXT, max(budget, 1), 64) if draft else None
    decoder = Decoder(target.model, target.stop_ids if stop_ids is None else stop_ids, config, speculator,
                      FixedBudget(budget))
    return decoder, decoder.generate(prompt, sampling or SamplingConfig())


PROMPTS = [[3, 9, 27, 5], [11, 2, 40, 40, 7, 1, 19], [6]]


@pytest.mark.parametrize("seed", range(6))
def test_greedy_speculation_equals_target_greedy_for_every_budget(pairs, seed):
    target_folder, close, far = pairs(seed)
    for draft_folder in (close, far):
        target, draft = load_pair(target_folder, draft_folder)
        for prompt in PROMPTS:
            _, reference = decode(target, None, prompt, 1)
            for budget in (1, 2, 3, 5, 8, 13, 32, 64):
                _, result = decode(target, draft, prompt, budget)
                assert result.token_ids == reference.token_ids, (seed, draft_folder.name, prompt, budget)
                assert result.stats.stop_reason == reference.stats.stop_reason


PENALTIES = [{"repetition_penalty": 1.5}, {"presence_penalty": 1.0, "frequency_penalty": 0.5},
             {"repetition_penalty": 1.2, "frequency_penalty": -0.4}]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda p: ",".join(p))
def test_greedy_speculation_with_penalties_equals_target_greedy(pairs, seed, penalties):
    """Each tree node is penalized over its own context (the committed tokens and its path)."""
    target_folder, close, far = pairs(seed)
    penalized = SamplingConfig(**penalties)
    changed = 0
    for draft_folder in (close, far):
        target, draft = load_pair(target_folder, draft_folder)
        for prompt in PROMPTS:
            _, reference = decode(target, None, prompt, 1, sampling=penalized)
            changed += reference.token_ids != decode(target, None, prompt, 1)[1].token_ids
            for budget in (2, 8, 32):
                _, result = decode(target, draft, prompt, budget, sampling=penalized)
                assert result.token_ids == reference.token_ids, (seed, draft_folder.name, prompt, budget)
    assert changed                                   # the penalty really changes answers


@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda p: ",".join(p))
def test_penalized_decoding_equals_a_plain_loop(pairs, penalties):
    """One-token decoding with penalties against a loop written from the definitions: the whole sequence
    through a fresh forward each step, transformers' repetition processor over prompt and answer, then
    presence and frequency over the answer's token counts, argmax."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    target_folder, _, _ = pairs(0)
    target, _ = load_pair(target_folder, target_folder)
    config = SamplingConfig(**penalties)
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(16):
            logits = target.model.forward(torch.tensor([ids]), target.model.new_cache(CONTEXT)).logits[0, -1:]
            logits = RepetitionPenaltyLogitsProcessor(config.repetition_penalty)(torch.tensor([ids]), logits)[0]
            counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long), minlength=VOCAB).float()
            logits = logits - config.frequency_penalty * counts - config.presence_penalty * (counts > 0).float()
            ids.append(int(logits.argmax()))
        _, result = decode(target, None, prompt, 1, max_new=16, sampling=config, stop_ids=set())
        assert result.token_ids == ids[len(prompt):], (prompt, penalties)


def test_the_draft_proposes_with_the_targets_repetition_penalty(pairs):
    """A draft's penalized log-probabilities: its logits, shifted to `logit_level`, through the target's rule
    over the seen ids (here the level is the draft's own log-sum-exp, so the shift is zero)."""
    from spec.penalties import Penalties
    from spec.sampling import penalize_repetition
    target_folder, close, _ = pairs(1)
    _, draft = load_pair(target_folder, close)
    cache = draft.model.new_cache(16)
    logits = draft.model.forward(torch.tensor([[3, 9, 27]]), cache, last_only=True).logits[0, :, :draft.num_rows]
    cache.truncate(0)
    penalties = Penalties(1.7, 0.0, 0.0, torch.tensor([3, 9]), torch.tensor([9, 9]), float(logits.logsumexp(-1)))
    got = draft.log_probs(torch.tensor([[3, 9, 27]]), cache, last_only=True, penalties=penalties,
                          paths=torch.tensor([[27, -1]]))
    expected = torch.log_softmax(penalize_repetition(logits.float(), torch.tensor([[3, 9, 27]]), 1.7), dim=-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(got, torch.log_softmax(logits.float(), dim=-1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tier", ["device", "ram"])
def test_greedy_speculation_on_cuda_equals_target_greedy(pairs, tier):
    """fp32 on the GPU: the tree's bookkeeping on the host, the passes on the device."""
    target_folder, close, _ = pairs(2)
    target, draft = load_pair(target_folder, close, tier, device="cuda")
    for prompt in PROMPTS:
        _, reference = decode(target, None, prompt, 1)
        for budget in (2, 8, 64):
            _, result = decode(target, draft, prompt, budget)
            assert result.token_ids == reference.token_ids, (tier, prompt, budget)
    target.layers.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_penalized_and_sampled_speculation_on_cuda(pairs):
    """Penalties (host ids against device logits) equal one-token decoding on the GPU; seeded sampling
    repeats itself, gives in-vocabulary tokens and the same answer without a draft."""
    target_folder, close, _ = pairs(2)
    target, draft = load_pair(target_folder, close, device="cuda")
    for penalties in PENALTIES:
        penalized = SamplingConfig(**penalties)
        _, reference = decode(target, None, PROMPTS[0], 1, sampling=penalized)
        _, result = decode(target, draft, PROMPTS[0], 16, sampling=penalized)
        assert result.token_ids == reference.token_ids, penalties
    sampled = SamplingConfig(temperature=0.8, top_p=0.9, seed=3, repetition_penalty=1.2)
    first, again = (decode(target, draft, PROMPTS[0], 16, sampling=sampled)[1] for _ in range(2))
    assert first.token_ids == again.token_ids and all(0 <= t < VOCAB for t in first.token_ids)
    assert decode(target, None, PROMPTS[0], 1, sampling=sampled)[1].token_ids == first.token_ids
    target.layers.close()


def test_seeded_sampling_gives_the_same_answer_whatever_the_tree(pairs):
    """Draws are keyed by answer position: no draft, small trees and large trees emit the same tokens."""
    target_folder, close, _ = pairs(0)
    target, draft = load_pair(target_folder, close)
    sampled = SamplingConfig(temperature=0.9, top_p=0.95, seed=11, repetition_penalty=1.1)
    _, alone = decode(target, None, PROMPTS[0], 1, max_new=30, sampling=sampled)
    for budget in (4, 32):
        _, result = decode(target, draft, PROMPTS[0], budget, max_new=30, sampling=sampled)
        assert result.token_ids == alone.token_ids, budget
        assert result.stats.tokens_per_pass > 1.2, budget       # the trees did accept tokens


def test_speculation_accepts_tokens_from_a_good_draft(pairs):
    target_folder, close, _ = pairs(0)
    target, draft = load_pair(target_folder, close)
    _, result = decode(target, draft, PROMPTS[0], 32, max_new=40, stop_ids=set())
    assert result.stats.tokens_per_pass > 2.0 and result.stats.num_steps < 20
    target, itself = load_pair(target_folder, target_folder)      # the target as its own draft
    chain = {"max_width": 1, "max_children": 1, "max_depth": 15}      # near-uniform guesses: go deep, not wide
    _, perfect = decode(target, itself, PROMPTS[0], 16, max_new=40, stop_ids=set(), growth=chain)
    assert perfect.stats.tokens_per_pass > 10


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_streamed_targets_give_the_same_tokens(pairs, tier):
    target_folder, close, _ = pairs(1)
    resident, draft = load_pair(target_folder, close)
    streamed, streamed_draft = load_pair(target_folder, close, tier)
    for budget in (1, 4, 16, 64):
        _, expected = decode(resident, draft, PROMPTS[1], budget)
        _, got = decode(streamed, streamed_draft, PROMPTS[1], budget)
        assert got.token_ids == expected.token_ids, (tier, budget)
    streamed.layers.close()


@pytest.mark.parametrize("growth", [{"max_width": 1, "max_children": 1}, {"max_width": 64, "max_children": 2},
                                    {"max_width": 2, "max_children": 32, "max_depth": 3}])
def test_tree_shapes_do_not_change_the_output(pairs, growth):
    target_folder, close, _ = pairs(2)
    target, draft = load_pair(target_folder, close)
    _, reference = decode(target, None, PROMPTS[0], 1, max_new=30)
    _, result = decode(target, draft, PROMPTS[0], 24, max_new=30, growth=growth)
    assert result.token_ids == reference.token_ids


def test_stop_tokens_and_length_inside_an_accepted_path_end_where_target_decoding_does(pairs):
    target_folder, _, _ = pairs(3)
    target, itself = load_pair(target_folder, target_folder)    # every draft token is accepted
    _, free = decode(target, None, PROMPTS[0], 1, max_new=30, stop_ids=set())
    stop = free.token_ids[7]
    for max_new in (1, 2, 5, 13):
        _, reference = decode(target, None, PROMPTS[0], 1, max_new=max_new, stop_ids={stop})
        decoder, result = decode(target, itself, PROMPTS[0], 16, max_new=max_new, stop_ids={stop})
        assert result.token_ids == reference.token_ids and result.stats.stop_reason == reference.stats.stop_reason
        assert decoder.cache.lengths[0] == len(decoder.slot_ids[0])


class EndsAfter:
    """A StopCondition that holds once the answer ends with `tail` (as a stop string's text would)."""

    def __init__(self, tail: list[int]) -> None:
        self.tail, self.calls = tail, 0

    def reached(self, answer_ids: list[int]) -> bool:
        self.calls += 1
        return answer_ids[-len(self.tail):] == self.tail


def test_a_stop_condition_inside_an_accepted_path_ends_where_target_decoding_does(pairs):
    target_folder, _, _ = pairs(3)
    target, itself = load_pair(target_folder, target_folder)    # every draft token is accepted
    _, free = decode(target, None, PROMPTS[0], 1, max_new=30, stop_ids=set())
    for end in (1, 6, 11):
        tail = free.token_ids[end - 1:end + 1] if end > 1 else free.token_ids[:1]
        first = next(i for i in range(len(free.token_ids)) if free.token_ids[max(i + 1 - len(tail), 0):i + 1] == tail)
        results = []
        for draft, budget in ((None, 1), (itself, 16)):
            config = DecodeConfig(30, CONTEXT, max_pass_tokens=64)
            speculator = Speculator(draft, CONTEXT, budget, 64) if draft else None
            decoder = Decoder(target.model, set(), config, speculator, FixedBudget(budget))
            results.append(decoder.generate(PROMPTS[0], SamplingConfig(), stop=EndsAfter(tail)))
            assert decoder.cache.lengths[0] == len(decoder.slot_ids[0])
        reference, speculative = results
        assert reference.token_ids == free.token_ids[:first + 1] and reference.stats.stop_reason == "stop_string"
        assert speculative.token_ids == reference.token_ids and speculative.stats.stop_reason == "stop_string"
        assert speculative.stats.tokens_per_pass > 1 or first < 2


def test_tree_shrinks_near_the_end_of_the_context(pairs):
    target_folder, close, _ = pairs(4)
    target, draft = load_pair(target_folder, close)
    prompt = list(range(1, 41)) * 3 + [5] * 30          # 150 of the 160 context tokens
    _, reference = decode(target, None, prompt, 1, max_new=40, stop_ids=set())
    decoder, result = decode(target, draft, prompt, 64, max_new=40, stop_ids=set())
    assert result.token_ids == reference.token_ids and result.stats.stop_reason == "context"
    assert max(result.stats.budgets) == CONTEXT - 1 - len(prompt) and decoder.cache.lengths[0] == CONTEXT - 1


class Interrupter:
    """Raises KeyboardInterrupt on the n-th call of a wrapped forward."""

    def __init__(self, forward, at_call: int):
        self.forward, self.at_call, self.calls = forward, at_call, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at_call:
            raise KeyboardInterrupt
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize("where, at_call", [("draft", 3), ("draft", 6), ("target", 3), ("target", 5)])
def test_ctrl_c_mid_growth_or_verification_leaves_both_caches_consistent(pairs, where, at_call, monkeypatch):
    target_folder, close, _ = pairs(5)
    target, draft = load_pair(target_folder, close)
    _, reference = decode(target, None, PROMPTS[2], 1, max_new=16)
    config = DecodeConfig(16, CONTEXT, max_pass_tokens=64)
    decoder = Decoder(target.model, target.stop_ids, config, Speculator(draft, CONTEXT, 16, 64), FixedBudget(16))
    model = draft.model if where == "draft" else target.model
    interrupter = Interrupter(model.forward, at_call)
    monkeypatch.setattr(model, "forward", interrupter)
    with pytest.raises(KeyboardInterrupt):
        decoder.generate(PROMPTS[0], SamplingConfig())
    monkeypatch.undo()
    assert decoder.cache.pending[0].numel() == 0 and decoder.cache.lengths[0] == len(decoder.slot_ids[0])
    speculator = decoder.speculator
    assert speculator.cache.pending[0].numel() == 0 and speculator.cache.lengths[0] == len(speculator.cached_ids[0])
    assert decoder.generate(PROMPTS[2], SamplingConfig()).token_ids == reference.token_ids


class DeviceOutput(torch.Tensor):
    """Stands for a tensor on a GPU: counts every read back to the host (each one waits for the
    device's queued work); what it computes stays 'on the device'."""
    reads = 0
    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(a == torch.device("cpu") or a == "cpu" for a in args[1:])
        if name in cls.READS or to_host or (name == "__getitem__" and _bool_index(args[1:])):
            cls.reads += 1
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {})).as_subclass(torch.Tensor) if to_host else func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


def _bool_index(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.bool or isinstance(a, tuple) and _bool_index(a)
               for a in args)


def test_tree_growth_reads_the_draft_device_once_per_round(pairs, monkeypatch):
    """The tree's bookkeeping stays on the host: per growth round only the children's top values and
    ids come back from the draft's device, in one copy (on a GPU each read waits for all queued work)."""
    target_folder, close, _ = pairs(0)
    target, draft = load_pair(target_folder, close)
    logits = draft.logits
    monkeypatch.setattr(draft, "logits", lambda *a, **k: logits(*a, **k).as_subclass(DeviceOutput))
    speculator = Speculator(draft, CONTEXT, 64, 64)
    DeviceOutput.reads = 0
    [(tree, slots)] = speculator.propose([Proposal(0, PROMPTS[1][:-1], PROMPTS[1][-1], GrowthConfig(64, max_width=4))])
    rounds = speculator.num_draft_forwards + 1          # the root's children, then one per forward
    assert tree.num_nodes == 64 and rounds > 3
    assert DeviceOutput.reads == rounds, (DeviceOutput.reads, rounds)
    assert not isinstance(tree.tokens, DeviceOutput) and tree.tokens.device.type == "cpu"


def test_a_speculative_step_reads_the_target_device_once(pairs, monkeypatch):
    """Verification reads the target's choices back once per step; acceptance and commits run on the
    host copy of the tree."""
    from offload.model.decoder import ForwardOutput
    target_folder, close, _ = pairs(0)
    target, draft = load_pair(target_folder, close)
    forward, passes = target.model.forward, []

    def on_device(*args, **kwargs):
        out = forward(*args, **kwargs)
        passes.append(1)
        return ForwardOutput(out.logits.as_subclass(DeviceOutput), out.hidden)

    monkeypatch.setattr(target.model, "forward", on_device)
    DeviceOutput.reads = 0
    _, result = decode(target, draft, PROMPTS[0], 16, max_new=24, stop_ids=set())
    assert result.stats.tokens_per_pass > 1.5
    assert DeviceOutput.reads == len(passes), (DeviceOutput.reads, len(passes))   # the prefill's first token too


@pytest.mark.parametrize("seed", [0, 3])
def test_tree_simulation_counts_the_passes_real_speculation_takes(pairs, seed):
    """`bench tree-simulation` grows the same trees against the target's greedy answer without target
    passes; its pass count must equal real greedy speculation's, budget by budget."""
    from spec.simulation import simulate
    target_folder, close, _ = pairs(seed)
    target, draft = load_pair(target_folder, close)
    counts = []
    for prompt in PROMPTS:
        _, reference = decode(target, None, prompt, 1, max_new=24)
        for budget in (1, 2, 5, 16, 64):
            _, result = decode(target, draft, prompt, budget, max_new=24)
            passes = simulate(draft, prompt, reference.token_ids, budget, 24, CONTEXT)
            assert passes == result.stats.num_steps, (prompt, budget)
            counts.append(passes)
    assert len(set(counts)) > 2      # the budgets made a difference: the count is not trivially fixed

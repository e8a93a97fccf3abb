"""spec/sampling.py: greedy, temperature, top-k / top-p / min-p filtering and seeding."""
from __future__ import annotations

import math

import pytest
import torch

from spec.sampling import SamplingConfig, make_generator, probabilities, sample

CPU = torch.device("cpu")
# a fixed distribution with distinct, easily checked probabilities
P = torch.tensor([0.05, 0.40, 0.02, 0.25, 0.15, 0.10, 0.03])
LOGITS = P.log() + 1.7   # a constant shift changes nothing


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = torch.randn(5, 3, 50, generator=_gen(0))
    config = SamplingConfig()
    assert config.is_greedy
    assert torch.equal(sample(logits, config), logits.argmax(-1))
    probs = probabilities(logits, config)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(5, 3)) and set(probs.unique().tolist()) == {0.0, 1.0}
    assert make_generator(config, CPU) is None


def test_top_k_one_equals_greedy():
    logits = torch.randn(200, 30, generator=_gen(1))
    config = SamplingConfig(temperature=1.3, top_k=1, seed=0)
    got = sample(logits, config, make_generator(config, CPU))
    assert torch.equal(got, logits.argmax(-1))
    assert torch.equal(probabilities(logits, config), torch.nn.functional.one_hot(logits.argmax(-1), 30).float())


def test_temperature_one_samples_follow_softmax():
    n = 20000
    config = SamplingConfig(temperature=1.0)
    draws = sample(LOGITS.expand(n, -1), config, _gen(1234))
    assert draws.shape == (n,)
    freq = torch.bincount(draws, minlength=len(P)).double() / n
    assert (freq - P.double()).abs().max() < 0.01
    # Pearson chi-square with 6 degrees of freedom: 22.46 is the 0.999 quantile
    expected = n * P.double()
    chi2 = ((freq * n - expected) ** 2 / expected).sum().item()
    assert chi2 < 22.46, chi2


def test_temperature_rescales_logits():
    config = SamplingConfig(temperature=0.5)
    expected = torch.softmax(LOGITS / 0.5, -1)
    torch.testing.assert_close(probabilities(LOGITS, config), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(probabilities(LOGITS, SamplingConfig(temperature=1.0)), P, atol=1e-6, rtol=0)


def _renormalised(keep: list[int]) -> torch.Tensor:
    kept = torch.zeros_like(P)
    kept[keep] = P[keep]
    return kept / kept.sum()


@pytest.mark.parametrize("top_k, keep", [(2, [1, 3]), (3, [1, 3, 4]), (100, list(range(7)))])
def test_top_k_keeps_k_most_likely(top_k, keep):
    probs = probabilities(LOGITS, SamplingConfig(temperature=1.0, top_k=top_k))
    torch.testing.assert_close(probs, _renormalised(keep), atol=1e-6, rtol=0)


# sorted: 0.40 (1), 0.25 (3), 0.15 (4), 0.10 (5), 0.05 (0), 0.03 (6), 0.02 (2)
@pytest.mark.parametrize("top_p, keep", [
    (0.3, [1]),                    # the top token alone already reaches 0.3
    (0.6, [1, 3]),                 # 0.40 + 0.25 = 0.65 >= 0.6
    (0.7, [1, 3, 4]),              # 0.65 < 0.7, add 0.15
    (0.85, [1, 3, 4, 5]),          # 0.80 < 0.85, add 0.10
    (0.99, [1, 3, 4, 5, 0, 6, 2]),
])
def test_top_p_zeroes_the_tail(top_p, keep):
    probs = probabilities(LOGITS, SamplingConfig(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, _renormalised(keep), atol=1e-6, rtol=0)
    assert (probs[[i for i in range(7) if i not in keep]] == 0).all()


@pytest.mark.parametrize("min_p, keep", [
    (0.1, [0, 1, 3, 4, 5]),        # threshold 0.04: drops 0.03 and 0.02
    (0.3, [1, 3, 4]),              # threshold 0.12
    (0.7, [1]),                    # threshold 0.28
])
def test_min_p_zeroes_unlikely_tokens(min_p, keep):
    probs = probabilities(LOGITS, SamplingConfig(temperature=1.0, min_p=min_p))
    torch.testing.assert_close(probs, _renormalised(keep), atol=1e-6, rtol=0)


def test_filters_apply_per_row():
    logits = torch.stack((LOGITS, LOGITS.flip(0)))
    probs = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.6))
    torch.testing.assert_close(probs[0], _renormalised([1, 3]), atol=1e-6, rtol=0)
    torch.testing.assert_close(probs[1], _renormalised([1, 3]).flip(0), atol=1e-6, rtol=0)


def test_filtered_tokens_are_never_sampled():
    config = SamplingConfig(temperature=1.0, top_p=0.7, seed=3)
    draws = sample(LOGITS.expand(5000, -1), config, make_generator(config, CPU))
    assert set(draws.unique().tolist()) == {1, 3, 4}


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2}, {"top_k": -1},
    {"min_p": -0.1}, {"min_p": 1.0},
])
def test_invalid_configs_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_same_seed_same_samples():
    logits = torch.randn(50, 100, generator=_gen(2))
    config = SamplingConfig(temperature=0.9, top_p=0.95, seed=42)
    first = [sample(logits, config, g) for g in [make_generator(config, CPU)] for _ in range(5)]
    second = [sample(logits, config, g) for g in [make_generator(config, CPU)] for _ in range(5)]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    other = SamplingConfig(temperature=0.9, top_p=0.95, seed=43)
    different = sample(logits, other, make_generator(other, CPU))
    assert not torch.equal(different, first[0])
    # a generator advances: successive draws from one generator differ
    assert not all(torch.equal(first[0], x) for x in first[1:])


def test_probabilities_are_a_distribution():
    logits = torch.randn(4, 64, generator=_gen(5)) * 3
    probs = probabilities(logits, SamplingConfig(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(4), atol=1e-6, rtol=0)
    assert (probs >= 0).all() and not math.isnan(probs.sum().item())


def test_unseeded_generator_is_made_for_sampling():
    generator = make_generator(SamplingConfig(temperature=1.0), CPU)
    assert isinstance(generator, torch.Generator)


def test_unseeded_generator_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    make_generator(SamplingConfig(temperature=1.0), CPU)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("penalty", [1.0, 1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    from spec.sampling import penalize_repetition
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=generator) * 3
    seen = torch.randint(0, 50, (3, 12), generator=generator)            # repeats included
    expected = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone())
    assert torch.equal(penalize_repetition(logits, seen, penalty), expected)
    assert penalty == 1.0 or not torch.equal(expected, logits)


@pytest.mark.parametrize("penalty", [0.0, -1.0, 11.0])
def test_repetition_penalty_out_of_range_is_refused(penalty):
    with pytest.raises(ValueError, match="repetition penalty"):
        SamplingConfig(repetition_penalty=penalty)


def test_presence_and_frequency_penalties_follow_the_counts():
    from spec.penalties import penalize_occurrences
    logits = torch.zeros(2, 6)
    seen = torch.tensor([[1, 1, 1, 4], [5, 0, 5, 5]])
    out = penalize_occurrences(logits, seen, presence=0.5, frequency=0.25)
    assert out[0].tolist() == [0, -1.25, 0, 0, -0.75, 0] and out[1].tolist() == [-0.75, 0, 0, 0, 0, -1.25]
    assert logits.eq(0).all()                          # the input is left as it was


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_openai_penalties_out_of_range_are_refused(name):
    with pytest.raises(ValueError, match=name.replace("_", " ")):
        SamplingConfig(**{name: 2.5})


# position-keyed draws (what the decoders use) ----------------------------------------------------------

def test_position_draws_are_a_pure_function_of_seed_and_position():
    from spec.sampling import PositionDraws
    a, b = PositionDraws(7), PositionDraws(7)
    assert a.uniforms(0, 50, CPU).tolist() == b.uniforms(0, 50, CPU).tolist()
    assert a.uniforms(10, 5, CPU).tolist() == a.uniforms(0, 15, CPU)[10:].tolist()   # any window, same values
    assert a.uniforms(0, 50, CPU).tolist() != PositionDraws(8).uniforms(0, 50, CPU).tolist()
    many = PositionDraws(3).uniforms(0, 20000, CPU)
    assert bool(((many >= 0) & (many < 1)).all())
    # uniform on [0, 1): every tenth holds 10% +- 1% (5 sigma) of the draws; neighbours uncorrelated
    shares = torch.bincount((many * 10).long(), minlength=10).double() / len(many)
    assert float((shares - 0.1).abs().max()) < 0.011
    assert abs(float(torch.corrcoef(torch.stack((many[:-1], many[1:])))[0, 1])) < 0.03
    with pytest.raises(ValueError, match="start at 0"):
        a.uniform(-1)


def test_sample_at_follows_the_distribution_and_never_a_filtered_token():
    from spec.sampling import sample_at
    n = 20000
    uniforms = torch.rand(n, dtype=torch.float64, generator=_gen(5))
    draws = sample_at(LOGITS.expand(n, -1), SamplingConfig(temperature=1.0), uniforms)
    freq = torch.bincount(draws, minlength=len(P)).double() / n
    assert float((freq - P.double()).abs().max()) < 5 * math.sqrt(0.25 / n)
    filtered = SamplingConfig(temperature=1.0, top_p=0.7)
    assert set(sample_at(LOGITS.expand(n, -1), filtered, uniforms).unique().tolist()) == {1, 3, 4}
    edges = torch.tensor([0.0, 1 - 2 ** -53], dtype=torch.float64)    # the extreme uniforms stay in range
    assert sample_at(LOGITS.expand(2, -1), filtered, edges).tolist() == [1, 4]
    assert torch.equal(sample_at(LOGITS.expand(3, -1), SamplingConfig(), None), LOGITS.expand(3, -1).argmax(-1))
    with pytest.raises(ValueError, match="one uniform per row"):
        sample_at(LOGITS.expand(3, -1), filtered, uniforms[:2])


def test_make_draws_is_none_when_greedy_and_seeded_when_asked():
    from spec.sampling import make_draws
    assert make_draws(SamplingConfig()) is None
    assert make_draws(SamplingConfig(temperature=1.0, seed=5)).seed == 5
    assert make_draws(SamplingConfig(temperature=1.0)).seed != make_draws(SamplingConfig(temperature=1.0)).seed

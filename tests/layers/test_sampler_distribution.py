"""The sampler draws from the distribution its parameters define, checked by counting many draws.

The expected distributions are computed here from the definitions (softmax(z / T), then top-k, then
the smallest top-p prefix), not with the sampler's code. Every generator is seeded, so the counts are
the same on every run; the bounds are 5 binomial standard deviations, so a correct sampler passes them
for any seed while one that ignores a parameter is off by many more.
"""

import numpy as np
import pytest

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.model_executor.layers.sampler import sample_one

EOS = 2
DRAWS = 4000


def request(output=(), seed=0, **params):
    r = Request("r", [7], SamplingParams(max_tokens=64, **params), eos_token_id=EOS)
    r.output_token_ids = list(output)
    r.generator = np.random.default_rng(seed)
    return r


def counts(logits, r, draws=DRAWS):
    z = np.asarray(logits, np.float32)
    return np.bincount([sample_one(z, r, EOS)[0] for _ in range(draws)], minlength=len(z))


def softmax(z, temperature=1.0):
    e = np.exp((np.asarray(z, np.float64) - max(z)) / temperature)
    return e / e.sum()


def assert_frequencies_match(observed, expected):
    n = observed.sum()
    sigma = np.sqrt(expected * (1 - expected) / n)
    freq = observed / n
    bad = {t: (round(freq[t], 4), round(expected[t], 4)) for t in range(len(expected))
           if abs(freq[t] - expected[t]) > 5 * sigma[t] + 1e-12}
    assert not bad, f"token: (observed, expected) frequency off by more than 5 sigma: {bad}"


# Distinct logits in descending order of token id, so "the k-th most likely token" is token k.
LADDER = [1.2, 1.0, 0.8, 0.6, 0.4, 0.2, 0.0, -0.2]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_match_softmax_of_logits_over_temperature(temperature):
    observed = counts(LADDER, request(temperature=temperature))
    assert_frequencies_match(observed, softmax(LADDER, temperature))


def test_temperature_changes_the_distribution_beyond_the_binomial_bound():
    # Guards the test above: at T = 0.5 the T = 1 distribution is far outside the bound.
    observed = counts(LADDER, request(temperature=0.5))
    with pytest.raises(AssertionError):
        assert_frequencies_match(observed, softmax(LADDER, 1.0))


@pytest.mark.parametrize("top_k", [1, 2, 3, 7])
def test_top_k_never_yields_the_k_plus_first_token_and_renormalises_the_rest(top_k):
    observed = counts(LADDER, request(temperature=1.0, top_k=top_k))
    assert observed[top_k:].sum() == 0, f"tokens ranked past top_k={top_k} were drawn: {observed}"
    expected = np.zeros(len(LADDER))
    expected[:top_k] = softmax(LADDER[:top_k])
    assert_frequencies_match(observed, expected)


def test_top_k_larger_than_the_vocabulary_or_disabled_keeps_every_token():
    for top_k in (0, -1, len(LADDER) + 5):
        assert_frequencies_match(counts(LADDER, request(temperature=1.0, top_k=top_k)), softmax(LADDER))


# Probabilities 0.5, 0.3, 0.15, 0.05: cumulative 0.5, 0.8, 0.95, 1.0.
MASS = np.log([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize("top_p,kept", [(0.3, 1), (0.49, 1), (0.51, 2), (0.79, 2), (0.81, 3), (0.94, 3),
                                        (0.96, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_top_p_including_the_crossing_token(top_p, kept):
    observed = counts(MASS, request(temperature=1.0, top_p=top_p))
    assert observed[kept:].sum() == 0, f"top_p={top_p} drew tokens past the first {kept}: {observed}"
    assert observed[kept - 1] > 0, f"top_p={top_p} never drew token {kept - 1}, whose mass crosses it"
    expected = np.zeros(len(MASS))
    expected[:kept] = softmax(MASS)[:kept] / softmax(MASS)[:kept].sum()
    assert_frequencies_match(observed, expected)


def test_top_p_applies_to_the_tempered_distribution_after_top_k():
    # T = 0.5 squares and renormalises the probabilities: 0.5^2, 0.3^2, 0.15^2 over their sum
    # (top_k = 3 drops the 4th) = 0.6897, 0.2483, 0.0621 -> cumulative 0.6897, 0.9379, 1.
    # top_p = 0.9 then keeps two tokens; on the untempered distribution it would keep three.
    observed = counts(MASS, request(temperature=0.5, top_k=3, top_p=0.9))
    p = softmax(MASS[:3], 0.5)
    expected = np.array([p[0], p[1], 0, 0]) / (p[0] + p[1])
    assert observed[2:].sum() == 0
    assert_frequencies_match(observed, expected)


def test_the_same_seed_draws_the_same_tokens_and_another_seed_other_ones():
    one = [sample_one(np.float32(LADDER), r, EOS)[0] for r in [request(temperature=1.0, seed=3)] for _ in range(50)]
    again = [sample_one(np.float32(LADDER), r, EOS)[0] for r in [request(temperature=1.0, seed=3)] for _ in range(50)]
    other = [sample_one(np.float32(LADDER), r, EOS)[0] for r in [request(temperature=1.0, seed=4)] for _ in range(50)]
    assert one == again and one != other


# EOS is by far the most likely token: without the ban it is drawn almost every time.
EOS_FAVOURED = [0.0, 0.0, 8.0, 1.0, 0.5]


@pytest.mark.parametrize("produced", [0, 1, 4])
def test_eos_and_stop_token_ids_are_never_drawn_before_min_tokens(produced):
    r = request(output=[3] * produced, temperature=1.0, min_tokens=5, stop_token_ids=[3])
    observed = counts(EOS_FAVOURED, r, draws=500)
    assert observed[EOS] == 0 and observed[3] == 0
    # The rest keep their relative weights (tokens 0, 1 and 4 renormalised).
    expected = softmax(EOS_FAVOURED) * np.array([1, 1, 0, 0, 1])
    assert_frequencies_match(observed, expected / expected.sum())
    greedy = request(output=[3] * produced, temperature=0, min_tokens=5)
    assert sample_one(np.float32(EOS_FAVOURED), greedy, EOS)[0] == 3


def test_eos_is_allowed_from_the_min_tokens_th_output_token_on():
    at_min = request(output=[3] * 5, temperature=0, min_tokens=5)
    assert sample_one(np.float32(EOS_FAVOURED), at_min, EOS)[0] == EOS
    sampled = counts(EOS_FAVOURED, request(output=[3] * 5, temperature=1.0, min_tokens=5), draws=500)
    assert_frequencies_match(sampled, softmax(EOS_FAVOURED))

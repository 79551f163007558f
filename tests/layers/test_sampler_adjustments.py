"""The sampler's exact arithmetic: logprobs, logit_bias, penalties at their edges, bad logits, ties.

Every expected value is worked out here (by hand or with math.log / math.exp), not with sampler.py.
"""

import math

import numpy as np
import pytest

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.model_executor.layers.sampler import GREEDY_TEMPERATURE, log_softmax, sample_one

EOS, VOCAB = 2, 8


def request(prompt=(7,), output=(), seed=0, **params):
    params = {"temperature": 0, **params}
    r = Request("r", list(prompt), SamplingParams(max_tokens=32, **params), eos_token_id=EOS)
    r.output_token_ids = list(output)
    r.generator = np.random.default_rng(seed)
    return r


def z(*values):
    out = np.full(VOCAB, -3.0, np.float32)
    out[:len(values)] = values
    return out


def reference_log_softmax(row):
    m = max(row)
    total = math.fsum(math.exp(v - m) for v in row)
    return [v - m - math.log(total) for v in row]


# -- logprobs ---------------------------------------------------------------------------------------
def test_logprobs_are_the_exact_log_softmax_of_the_logits():
    logits = z(2.0, 1.0, 0.5, -1.0)
    token, lps = sample_one(logits, request(logprobs=3), EOS)
    ref = reference_log_softmax([float(v) for v in logits])
    assert token == 0
    assert lps.keys() == {0, 1, 2}
    for t, lp in lps.items():
        assert lp == pytest.approx(ref[t], abs=1e-12)


def test_logprobs_of_huge_logits_do_not_overflow():
    logits = np.array([1000.0, 999.0] + [900.0] * (VOCAB - 2), np.float32)
    _, lps = sample_one(logits, request(logprobs=2), EOS)
    assert lps[0] == pytest.approx(-math.log1p(math.exp(-1.0) + 6 * math.exp(-100.0)), abs=1e-12)
    assert lps[1] == pytest.approx(lps[0] - 1.0, abs=1e-12)


def test_log_softmax_normalises_each_row_of_a_batch():
    # Rows far apart: each must be shifted by its own maximum, or exp() of the low row underflows.
    batch = np.array([[0.0, 1.0, 2.0], [5.0, 5.0, -5.0], [1000.0, 999.0, 990.0]])
    out = log_softmax(batch)
    assert out.shape == batch.shape
    for row, ref in zip(out, map(reference_log_softmax, batch.tolist())):
        assert row.tolist() == pytest.approx(ref, abs=1e-12)


def test_no_logprobs_asked_means_none_returned():
    assert sample_one(z(1.0), request(), EOS)[1] is None
    assert sample_one(z(1.0), request(temperature=1.0), EOS)[1] is None


def test_the_sampled_token_is_added_to_the_top_logprobs_when_outside_them():
    logits = z(2.0, 1.0, 0.5)
    token, lps = sample_one(logits, request(logprobs=1, logit_bias={2: 5.0}), EOS)
    assert token == 2 and lps.keys() == {0, 2}


# -- logit_bias -------------------------------------------------------------------------------------
def test_logit_bias_adds_each_value_to_its_own_token():
    logits = z(1.0, 0.5, 0.2)
    assert sample_one(logits, request(logit_bias={1: 0.8}), EOS)[0] == 1     # 1.3 > 1.0 (added, not set)
    assert sample_one(logits, request(logit_bias={1: 0.4}), EOS)[0] == 0     # 0.9 < 1.0
    assert sample_one(logits, request(logit_bias={0: -0.6, 2: 0.5}), EOS)[0] == 2   # 0.4, 0.5, 0.7
    assert sample_one(logits, request(logit_bias={2: 0.5, 0: -0.6}), EOS)[0] == 2   # order does not matter
    assert sample_one(logits, request(logit_bias={0: -0.6, 2: 0.2}), EOS)[0] == 1   # 0.4, 0.5, 0.4


def test_logit_bias_shifts_the_sampled_distribution_exactly():
    logits = np.zeros(VOCAB, np.float32)
    r = request(temperature=1.0, logit_bias={3: math.log(3.0), 5: -100.0})
    draws = np.bincount([sample_one(logits, r, EOS)[0] for _ in range(3000)], minlength=VOCAB)
    # Token 3 has weight 3, token 5 weight e^-100 ~ 0, the other six weight 1: p(3) = 3/9.
    assert draws[5] == 0
    assert abs(draws[3] / 3000 - 1 / 3) < 5 * math.sqrt((1 / 3) * (2 / 3) / 3000)


# -- penalties at their edges -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_a_penalty_of_exactly_one_is_applied(name):
    # 1.0 - 1.0 * 1 occurrence = 0.0 < 0.5
    assert sample_one(z(0.0, 1.0, 0.5), request(output=[1], **{name: 1.0}), EOS)[0] == 2


def test_presence_penalty_applies_after_a_single_occurrence():
    assert sample_one(z(0.0, 1.0, 0.5), request(output=[1], presence_penalty=0.6), EOS)[0] == 2


def test_repetition_penalty_divides_a_positive_logit_that_still_wins():
    # 1.0 / 2 = 0.5 > 0.4: the penalised token keeps its (reduced) logit.
    assert sample_one(z(0.0, 1.0, 0.4), request(prompt=[1], repetition_penalty=2.0), EOS)[0] == 1


def test_repetition_penalty_multiplies_a_negative_logit_that_still_wins():
    # -0.1 * 2 = -0.2 > -0.25
    logits = np.full(VOCAB, -5.0, np.float32)
    logits[1], logits[2] = -0.1, -0.25
    assert sample_one(logits, request(prompt=[1], repetition_penalty=2.0), EOS)[0] == 1


def test_out_of_vocabulary_ids_in_prompt_or_stop_ids_are_ignored_not_an_index_error():
    r = request(prompt=[VOCAB, 1], repetition_penalty=2.0, min_tokens=2, stop_token_ids=[VOCAB])
    assert sample_one(z(0.0, 1.0, 0.4), r, EOS)[0] == 1


# -- bad logits and bans ------------------------------------------------------------------------------
def test_a_nan_logit_is_never_chosen():
    logits = np.full(VOCAB, -2.0, np.float32)
    logits[0], logits[4] = np.nan, -1.0
    assert sample_one(logits, request(), EOS)[0] == 4
    r = request(temperature=1.0, logprobs=None)
    assert all(sample_one(logits, r, EOS)[0] != 0 for _ in range(200))


def test_negative_infinity_logits_stay_impossible_and_can_make_every_token_banned():
    logits = np.full(VOCAB, -np.inf, np.float32)
    logits[EOS] = 0.0
    assert sample_one(logits, request(), EOS)[0] == EOS
    with pytest.raises(ValueError, match="^every token is banned"):
        sample_one(logits, request(min_tokens=1), EOS)
    logits[6] = -1.0
    r = request(temperature=1.0, min_tokens=1)
    assert {sample_one(logits, r, EOS)[0] for _ in range(50)} == {6}


def test_greedy_starts_strictly_below_the_greedy_temperature():
    near_tie = np.zeros(VOCAB, np.float32)
    near_tie[0], near_tie[1] = 1.0, 1.0 - 1e-6  # at T = 1e-5 their weights are 1 : e^-0.1
    at = request(temperature=GREEDY_TEMPERATURE)
    drawn = {sample_one(near_tie, at, EOS)[0] for _ in range(100)}
    assert drawn == {0, 1}
    below = request(temperature=GREEDY_TEMPERATURE / 2)
    assert {sample_one(near_tie, below, EOS)[0] for _ in range(20)} == {0}


# -- ties -------------------------------------------------------------------------------------------
TIES = np.array([float((i * 7) % 3) for i in range(300)], np.float32)  # values 0, 1, 2 in a repeating pattern
TOP_TIED = [i for i in range(300) if TIES[i] == 2.0]


def test_ties_in_top_k_are_broken_toward_the_lowest_token_id():
    r = request(temperature=1.0, top_k=5)
    drawn = {sample_one(TIES, r, EOS)[0] for _ in range(400)}
    assert drawn == set(TOP_TIED[:5])


def test_ties_in_top_logprobs_are_broken_toward_the_lowest_token_id():
    _, lps = sample_one(TIES, request(logprobs=6), EOS)
    assert sorted(lps) == TOP_TIED[:6]

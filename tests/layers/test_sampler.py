"""The sampler's logit adjustments, on hand-made logits with real Request objects."""

import numpy as np
import pytest

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.model_executor.layers.sampler import sample_one

VOCAB, EOS = 16, 2


def request(prompt=(7,), output=(), **params):
    params = {"temperature": 0, "logprobs": 3, **params}
    r = Request("r", list(prompt), SamplingParams(max_tokens=32, **params), eos_token_id=EOS)
    r.output_token_ids = list(output)
    return r


def logits(**values):
    out = np.zeros(VOCAB, np.float32)
    for token, value in values.items():
        out[int(token[1:])] = value
    return out


def test_frequency_penalty_subtracts_per_occurrence_and_presence_once():
    z = logits(t5=1.0, t6=0.5)
    assert sample_one(z, request(output=[5]), EOS)[0] == 5
    # 1.0 - 0.6 * 1 = 0.4 < 0.5
    assert sample_one(z, request(output=[5], frequency_penalty=0.6), EOS)[0] == 6
    # 1.0 - 0.3 * 2 = 0.4 < 0.5, but once: 1.0 - 0.3 = 0.7 > 0.5
    assert sample_one(z, request(output=[5, 5], frequency_penalty=0.3), EOS)[0] == 6
    assert sample_one(z, request(output=[5, 5], presence_penalty=0.3), EOS)[0] == 5
    assert sample_one(z, request(output=[5, 5], presence_penalty=0.6), EOS)[0] == 6


def test_repetition_penalty_covers_the_prompt_and_shrinks_positive_grows_negative_logits():
    z = logits(t5=1.0, t6=0.6)
    assert sample_one(z, request(prompt=[5]), EOS)[0] == 5
    assert sample_one(z, request(prompt=[5], repetition_penalty=2.0), EOS)[0] == 6  # 1.0 / 2 < 0.6
    neg = logits(t5=-0.1, t6=-0.15, t0=-1, t1=-1, t2=-1, t3=-1, t4=-1, t7=-1, t8=-1, t9=-1, t10=-1, t11=-1,
                 t12=-1, t13=-1, t14=-1, t15=-1)
    assert sample_one(neg, request(prompt=[9], output=[5], repetition_penalty=2.0), EOS)[0] == 6  # -0.2 < -0.15


def test_logprobs_report_the_unpenalised_distribution():
    z = logits(t5=1.0, t6=0.5)
    token, lps = sample_one(z, request(output=[5], frequency_penalty=2.0), EOS)
    assert token == 6
    assert max(lps, key=lps.get) == 5


@pytest.mark.parametrize("params", [dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                    dict(repetition_penalty=0), dict(repetition_penalty=1000)])
def test_out_of_range_penalties_are_rejected(params):
    with pytest.raises(ValueError, match="penalty"):
        SamplingParams(**params).validate()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no numpy overflow warning either
def test_extreme_but_valid_parameters_sample_without_overflow():
    z = logits(t5=3.0, t6=0.5)
    r = request(prompt=[5, 6], repetition_penalty=1e-308, temperature=1.0, logprobs=None)
    r.generator = np.random.default_rng(0)
    assert sample_one(z, r, EOS)[0] in range(VOCAB)  # 3.0 / 1e-308 overflows to +inf unless guarded
    tiny = request(temperature=1e-300, logprobs=None)
    tiny.generator = np.random.default_rng(0)
    assert sample_one(z, tiny, EOS)[0] == 5  # a temperature this small is greedy


def test_a_distribution_with_every_token_banned_is_an_error_not_a_nan_draw():
    r = request(output=[], min_tokens=3, stop_token_ids=list(range(VOCAB)), temperature=1.0)
    r.generator = np.random.default_rng(0)
    with pytest.raises(ValueError, match="banned"):
        sample_one(logits(t5=1.0), r, EOS)

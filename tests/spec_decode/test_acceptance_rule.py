"""The acceptance rule keeps the model's distribution: a one-candidate draft x is accepted with
probability p(x) of the adjusted distribution, a rejection yields p with x removed, renormalised,
and the emitted token is distributed as p itself (checked by counting, against p computed here)."""

import numpy as np
import pytest

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.model_executor.layers.sampler import sample_one
from fastdeploy.spec_decode.verify import AcceptedHistory, accept_drafts

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

LOGITS = np.log(np.array([0.05, 0.3, 0.1, 0.25, 0.02, 0.18, 0.07, 0.03], np.float32))
TRIALS = 20000


def verify_one_draft(draft, params, seed):
    request = Request("r", [1, 2], params)
    request.generator = np.random.default_rng(seed)
    rows = [LOGITS, LOGITS]  # the row after the draft is not what this test counts
    return accept_drafts([draft], lambda j, accepted: sample_one(rows[j], AcceptedHistory(request, accepted), 0))[0]


def adjusted(top_k=0):
    p = np.exp(LOGITS.astype(np.float64))
    p /= p.sum()
    if top_k:
        p[np.argsort(-p, kind="stable")[top_k:]] = 0
        p /= p.sum()
    return p


@pytest.mark.parametrize("draft,top_k", [(1, 0), (5, 0), (4, 0), (6, 3)])
def test_a_draft_is_accepted_with_its_probability_and_a_rejection_samples_the_rest(draft, top_k):
    params = SamplingParams(temperature=1.0, top_k=top_k)
    p = adjusted(top_k)
    firsts = np.array([verify_one_draft(draft, params, seed)[0] for seed in range(TRIALS)])
    accepted = firsts == draft
    sigma = np.sqrt(p[draft] * (1 - p[draft]) / TRIALS)
    assert abs(accepted.mean() - p[draft]) <= 4 * sigma + 1e-12
    rest = np.bincount(firsts[~accepted], minlength=len(p)) / max(1, (~accepted).sum())
    want = p.copy()
    want[draft] = 0
    want /= want.sum()
    assert rest[draft] == 0
    assert np.abs(rest - want).max() < 0.02
    emitted = np.bincount(firsts, minlength=len(p)) / TRIALS
    assert np.abs(emitted - p).max() < 0.02


def test_an_accepted_draft_is_followed_by_the_next_rows_token_and_a_rejection_ends_the_run():
    params = SamplingParams(temperature=1.0)
    lengths = {len(verify_one_draft(1, params, seed)) for seed in range(200)}
    assert lengths == {1, 2}
    for seed in range(200):
        tokens = verify_one_draft(1, params, seed)
        assert (len(tokens) == 2) == (tokens[0] == 1)

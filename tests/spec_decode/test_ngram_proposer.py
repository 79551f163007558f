"""Prompt-lookup drafts: the latest earlier occurrence of the longest matching suffix n-gram, and the
incremental index agrees with a plain search at every step of a growing request."""

from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.spec_decode.ngram import NgramProposer


def request_of(tokens):
    return Request("r", tokens, SamplingParams(max_tokens=100))


def plain_search(tokens, min_n, max_n, k):
    """The definition, written out: longest n first, latest earlier occurrence, what followed it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_the_tokens_after_the_latest_earlier_occurrence_are_proposed():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert NgramProposer(2, 3).propose(request_of(tokens), 3) == [7, 8, 5]


def test_a_longer_match_wins_over_a_later_shorter_one():
    tokens = [4, 2, 3, 5, 6, 9, 2, 3, 8, 8, 4, 2, 3]  # "2 3" last seen before 8; "4 2 3" before 5
    assert NgramProposer(2, 3).propose(request_of(tokens), 2) == [5, 6]
    assert NgramProposer(2, 2).propose(request_of(tokens), 2) == [8, 8]


def test_no_match_and_too_short_requests_propose_nothing():
    assert NgramProposer(2, 4).propose(request_of([1, 2, 3, 4, 5]), 4) == []
    assert NgramProposer(2, 4).propose(request_of([1, 1]), 4) == []
    assert NgramProposer(2, 4).propose(request_of([1, 2, 1, 2]), 0) == []


def test_a_match_near_the_end_proposes_what_exists():
    # "1 1" last occurred at positions 3..4: only the final token follows it
    assert NgramProposer(2, 2).propose(request_of([5, 6, 1, 1, 1]), 4) == [1]


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=30),
       outputs=st.lists(st.integers(0, 3), max_size=30), sizes=st.tuples(st.integers(1, 3), st.integers(0, 3)),
       k=st.integers(1, 5))
def test_the_incremental_index_agrees_with_a_plain_search_as_the_request_grows(prompt, outputs, sizes, k):
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    proposer = NgramProposer(min_n, max_n)
    request = request_of(prompt)
    for token in [None] + outputs:
        if token is not None:
            request.append_output(token)
        tokens = request.prompt_token_ids + request.output_token_ids
        expected = plain_search(tokens, min_n, max_n, k) if len(tokens) > min_n else []
        assert proposer.propose(request, k) == expected

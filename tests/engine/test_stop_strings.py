"""Stop-string search and hold-back: the text a client sees never shows what the final answer cuts."""

from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy.engine.stop_strings import find_stop, releasable


def test_a_stop_string_split_across_checks_is_found_where_it_begins():
    assert find_stop("hello wor", ["world"], checked=0) is None
    assert find_stop("hello world", ["world"], checked=len("hello wor")) == 6


def test_the_earliest_of_several_stop_strings_wins():
    assert find_stop("abcXYdefZ", ["Z", "XY", "def"], checked=0) == 3


def test_only_stop_strings_ending_in_the_unchecked_text_count():
    # "ab" ends inside the checked text (say, before min_tokens): a later call must not find it.
    assert find_stop("ab" + "x" * 10, ["ab", "xxxxxxxxxxxxxxx"], checked=12) is None
    assert find_stop("abxa", ["ab", "xa"], checked=3) == 2


def test_the_tail_that_may_grow_into_a_stop_string_is_held_back():
    assert releasable("say STO", ["STOP"]) == "say "
    assert releasable("say ST", ["STOP", "TX"]) == "say "
    assert releasable("say S", ["STOP"]) == "say "
    assert releasable("say SX", ["STOP"]) == "say SX"
    assert releasable("", ["STOP"]) == ""


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
                                                                 min_size=1, max_size=3))
def test_streamed_visible_text_only_grows_and_is_a_prefix_of_the_final_answer(text, stops):
    """Feed the text one character at a time, as the engine does; check what a client would see."""
    shown, checked = "", 0
    for n in range(1, len(text) + 1):
        prefix = text[:n]
        cut = find_stop(prefix, stops, checked)
        if cut is not None:
            final = prefix[:cut]
            break
        checked = n
        visible = releasable(prefix, stops)
        assert visible.startswith(shown)
        shown = visible
    else:
        final = text
    assert final.startswith(shown)
    assert not any(s in final for s in stops)

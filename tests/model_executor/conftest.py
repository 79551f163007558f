"""These tests pick their memory mode explicitly: start each from the defaults (1-D, paged
attention), whatever env flags an earlier test module left in the process environment."""

import pytest

DEFAULT_FLAGS = {"FD_HEAD_WISE_KV_CACHE": "0", "FD_HEAD_WISE_SWA_RECYCLE": "1", "FD_ATTENTION_BACKEND": "APPEND_ATTN"}


@pytest.fixture(scope="module", autouse=True)
def default_env_flags():
    with pytest.MonkeyPatch.context() as mp:
        for name, value in DEFAULT_FLAGS.items():
            mp.setenv(name, value)
        yield

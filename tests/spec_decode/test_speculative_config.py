"""--speculative-config / LLM(speculative_config=...): upstream names, defaults, one-line errors."""

import pytest

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.openai import api_server
from fastdeploy.spec_decode.config import SpeculativeConfig


def test_upstream_fastdeploy_and_vllm_names_give_the_same_config():
    fastdeploy = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "max_ngram_size": 5,
                                          "min_ngram_size": 2})
    vllm = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
                                   '"prompt_lookup_min": 2}')
    older = SpeculativeConfig.parse({"method": "ngram_match", "num_speculative_tokens": 3, "max_ngram_size": 5,
                                     "min_ngram_size": 2})
    assert fastdeploy == vllm == older
    assert fastdeploy.method == "ngram"


def test_only_the_method_is_required_and_empty_means_off():
    assert SpeculativeConfig.parse({"method": "ngram"}) == SpeculativeConfig()
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse({}) is None


def test_the_batch_size_threshold_turns_drafts_off_above_it():
    config = SpeculativeConfig.parse({"method": "ngram", "disable_by_batch_size": 4})
    assert config.speculates_with(4) and not config.speculates_with(5)
    assert SpeculativeConfig.parse({"method": "ngram", "disable_by_batch_size": None}).speculates_with(10 ** 6)


@pytest.mark.parametrize("value,message", [
    ('{"method": "ngram",', "not valid JSON"),
    ("[1]", "expected a JSON object"),
    ({"num_speculative_tokens": 2}, "'method' is required"),
    ({"method": "mtp"}, "method 'mtp' is not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "min_ngram_size (4) must not exceed"),
    ({"method": "ngram", "max_ngram_size": 3, "prompt_lookup_max": 3}, "'prompt_lookup_max' repeats"),
    ({"method": "ngram", "draft_model": "x"}, "unknown field 'draft_model'"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size must be an integer >= 1 or null"),
])
def test_invalid_configs_fail_at_start_up_naming_the_field(value, message):
    with pytest.raises(ValueError, match="speculative_config") as err:
        EngineArgs(speculative_config=value).create_engine_config()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_server_refuses_a_bad_config_with_one_line_before_serving(capsys):
    code = api_server.main(["--port", "0", "--speculative-config", '{"method": "eagle"}'])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == "error: speculative_config: method 'eagle' is not supported (supported: ngram)"

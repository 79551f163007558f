"""--kv-events-config: vLLM's JSON shape, refused by field name where it is wrong; events need the prefix cache."""

import json

import pytest

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.kv_events_publisher import KVEventsConfig


def test_vllms_fields_are_read_and_events_off_means_no_config():
    config = KVEventsConfig.parse(json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                                              "buffer_steps": 100, "hwm": 1000, "max_queue_size": 10, "topic": "kv"}))
    assert (config.endpoint, config.replay_endpoint, config.buffer_steps, config.topic) == \
        ("tcp://*:5557", "tcp://*:5558", 100, "kv")
    assert config.stored_blocks == "hit_paths"  # this engine's field; the default
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "stored_blocks": "hit_ends"}').stored_blocks == \
        "hit_ends"
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None


@pytest.mark.parametrize("spec, named", [
    ('{"enable_kv_cache_events": true, "endpoit": "tcp://*:1"}', "endpoit"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "kafka"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "endpoint"),
    ('{"enable_kv_cache_events": true, "stored_blocks": "all"}', "stored_blocks 'all' is not one of"),
    ('[1]', "JSON object"),
    ('{nope', "not valid JSON"),
])
def test_a_bad_field_is_refused_by_name(spec, named):
    with pytest.raises(ValueError, match=named):
        KVEventsConfig.parse(spec)


def test_events_without_the_prefix_cache_are_refused_at_start_up():
    with pytest.raises(ValueError, match="prefix cache"):
        EngineArgs(enable_prefix_caching=False,
                   kv_events_config='{"enable_kv_cache_events": true}').create_engine_config()

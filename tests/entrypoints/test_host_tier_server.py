"""An api_server with --swap-space: a conversation the pool evicted comes back from the host tier, the client
sees its cached_tokens in usage, and /metrics shows the tier (ours and upstream's CPU-cache names)."""

import pytest

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`


def text(n, seed):
    return [3 + (i * 37 + seed * 11 + (i * i + seed) % 23) % 250 for i in range(n)]


SYSTEMS = [text(300, 10 + k) for k in range(4)]  # tiny preset: longer than its 128-token window


@pytest.mark.parametrize("flag", ["0", "1"])
def test_a_prompt_the_pool_evicted_is_served_from_the_host_tier_and_reported(server_factory, flag):
    server = server_factory("--max-model-len", "512", "--block-size", "16", "--num-gpu-blocks-override", "48",
                            "--swap-space", "0.02", env={"FD_HEAD_WISE_KV_CACHE": flag})

    def complete(prompt):
        body = server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                        "ignore_eos": True}).json()
        return body["choices"][0]["text"], body["usage"]

    first = {}
    for k, system in enumerate(SYSTEMS):  # two conversations each: the prompt's end becomes a branch point
        first[k] = complete(system + text(20, k))[0]
        complete(system + text(20, 50 + k))
    before = server.wait_idle_with_all_pages_free()
    text0, usage = complete(SYSTEMS[0] + text(20, 0))  # evicted from the pool by the three others
    assert text0 == first[0]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 288  # the system prompt's 18 blocks
    m = server.wait_idle_with_all_pages_free()
    assert m["fastdeploy:prefix_cache_host_hit_tokens_total"] - before["fastdeploy:prefix_cache_host_hit_tokens_total"] \
        >= 288 - 16
    assert m["fastdeploy:host_cache_loaded_pages_total"] > 0 and m["fastdeploy:host_cache_loads_total"] >= 1
    assert m["fastdeploy:host_cache_pages"] > 0
    assert m["fastdeploy:host_cache_bytes"] > 0 and m["fastdeploy:host_cache_pages_total"] >= m["fastdeploy:host_cache_pages"]
    assert m["fastdeploy:cpu_hit_token_rate"] > 0
    assert m["fastdeploy:prefix_cpu_cache_token_num_total"] == m["fastdeploy:prefix_cache_host_hit_tokens_total"]
    assert m["fastdeploy:prefix_gpu_cache_token_num_total"] + m["fastdeploy:prefix_cpu_cache_token_num_total"] \
        == m["fastdeploy:prefix_cache_token_num_total"]


def test_after_a_restart_the_disk_tier_serves_the_first_turn_and_metrics_show_it(server_factory, tmp_path):
    """--kvcache-storage-backend file: SIGTERM writes the cache to files; the next server with the same model
    and layout finds them, so its first request is a hit (the same text as before the restart)."""
    args = ("--max-model-len", "512", "--block-size", "16", "--num-gpu-blocks-override", "48", "--swap-space", "0.0005",
            "--kvcache-storage-backend", "file", "--kvcache-storage-path", str(tmp_path))

    def complete(server, prompt):
        body = server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                        "ignore_eos": True}).json()
        return body["choices"][0]["text"], body["usage"]

    first = server_factory(*args)
    answers = {}
    for k, system in enumerate(SYSTEMS):  # two conversations each: the prompt's end becomes a branch point
        answers[k] = complete(first, system + text(20, k))[0]
        complete(first, system + text(20, 50 + k))
    assert first.stop() == 0, first.log_tail()
    assert "pages written for the next start" in first.log_tail()

    second = server_factory(*args)
    restored = second.metrics()["fastdeploy:disk_cache_restored_pages"]
    assert restored > 0
    for k, system in enumerate(SYSTEMS):
        answer, usage = complete(second, system + text(20, k))
        assert answer == answers[k]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 288  # the system prompt, read from disk
    m = second.wait_idle_with_all_pages_free()
    assert m["fastdeploy:disk_cache_loaded_pages_total"] > 0 and m["fastdeploy:disk_cache_corrupt_files_total"] == 0
    assert m["fastdeploy:prefix_cache_host_hit_tokens_total"] >= 4 * 288

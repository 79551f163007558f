"""`api_server --model gemma-3-270m` with FD_HEAD_WISE_KV_CACHE=1 (slots + recycling of its sliding layers),
over real HTTP: /metrics carries every KV page gauge in every scrape from the moment /health is 200, through
a long prefill; the base model answers a factual chat question (the file has no chat template: the plain
transcript serves, and the assistant's turn ends at the next user line)."""

import threading
import time

import pydoc_data.topics
import pytest

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

GAUGES = ("fastdeploy:kv_pages_total", "fastdeploy:kv_pages_free", "fastdeploy:num_requests_running",
          "fastdeploy:num_requests_waiting", "fastdeploy:swa_pages_recycled_total",
          "fastdeploy:num_preemptions_total", "fastdeploy:gpu_cache_usage_perc")


@pytest.fixture(scope="module")
def server(server_factory, helpers):
    path = helpers.named_model_path("gemma-3-270m")
    # The suite's base flags size the cache for the tiny preset; a 4096-token context needs more blocks.
    return server_factory("--model", path, "--max-model-len", "4096", "--num-gpu-blocks-override", "512",
                          "--max-num-batched-tokens", "2048", env={"FD_HEAD_WISE_KV_CACHE": "1"})


def test_every_scrape_carries_the_page_gauges_from_health_through_a_long_prefill(server, helpers):
    """Scraped every 50 ms from right after start-up while a ~2.5k-token prompt is prefilled and decoded."""
    scrapes, stop = [], threading.Event()

    def scrape():
        while not stop.is_set():
            scrapes.append(server.metrics())
            time.sleep(0.05)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        prose = " ".join(pydoc_data.topics.topics.values())[:11000]
        resp = server.http.post("/v1/completions", json={"model": server.model_name(), "prompt": prose,
                                                          "max_tokens": 4, "temperature": 0})
    finally:
        stop.set()
        scraper.join(timeout=helpers.REQUEST_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] > 2048  # more than one chunk, past the 512-token window
    assert len(scrapes) > 10
    missing = [(i, name) for i, scrape in enumerate(scrapes) for name in GAUGES if name not in scrape]
    assert not missing, missing[:10]
    assert any(s["fastdeploy:kv_pages_free"] < s["fastdeploy:kv_pages_total"] for s in scrapes)  # seen busy
    assert server.wait_idle_with_all_pages_free()["fastdeploy:swa_pages_recycled_total"] > 0


def test_chat_answers_a_factual_question_and_ends_its_turn(server):
    resp = server.http.post("/v1/chat/completions", json={
        "model": server.model_name(), "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and "User:" not in choice["message"]["content"]


def test_tokenize_puts_bos_first_unless_add_special_tokens_is_false(server):
    """Gemma 3's tokenizer adds <bos>: /tokenize adds it by default (the ids a completion runs), leaves it
    out with add_special_tokens false, and a chat prompt carries it once either way it is asked."""
    info = server.http.get("/tokenizer_info").json()
    bos = server.http.post("/tokenize", json={"prompt": info["bos_token"], "add_special_tokens": False}).json()
    assert bos["count"] == 1
    bos_id = bos["tokens"][0]
    default = server.http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    plain = server.http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    assert default == [bos_id] + plain and bos_id not in plain
    completion = server.http.post("/v1/completions", json={"model": server.model_name(), "prompt": "Hello world",
                                                            "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == len(default)
    messages = [{"role": "user", "content": "Hi"}]
    chat_ids = server.http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    explicit = server.http.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()["tokens"]
    bare = server.http.post("/tokenize", json={"messages": messages, "add_special_tokens": False}).json()["tokens"]
    assert chat_ids == explicit and chat_ids.count(bos_id) == 1
    assert [bos_id] + bare == chat_ids

"""The OpenAI-compatible server, driven by the real `openai` client over HTTP.

One server per module (tiny preset, head-wise KV cache) with a separate metrics port.
"""

from __future__ import annotations

import json

import time

import pytest

from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_NAME

MAX_MODEL_LEN = 256
REQUIRED_METRICS = (
    "fastdeploy:kv_pages_total", "fastdeploy:kv_pages_free", "fastdeploy:num_requests_running",
    "fastdeploy:num_requests_waiting", "fastdeploy:swa_pages_recycled_total", "fastdeploy:num_preemptions_total",
    "fastdeploy:prompt_tokens_total", "fastdeploy:generation_tokens_total", "fastdeploy:engine_steps_total",
    "fastdeploy:prefix_cache_hit_tokens_total", "fastdeploy:prefix_cache_query_tokens_total",
    "fastdeploy:prefix_cache_cached_pages", "fastdeploy:prefix_cache_evictions_total",
)


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--max-model-len", str(MAX_MODEL_LEN), separate_metrics_port=True)


@pytest.fixture(scope="module")
def client(server):
    with server.openai_client() as c:
        yield c


@pytest.fixture(scope="module")
def model(server):
    return server.model_name()


def sse_events(raw: bytes) -> list[str]:
    return [line[len("data: "):] for line in raw.decode().split("\n") if line.startswith("data: ")]


def test_health_is_ok_once_ready(server):
    resp = server.http.get("/health")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok"}


def test_models_lists_the_served_model_with_its_limits(server):
    data = server.http.get("/v1/models").json()["data"]
    assert len(data) == 1
    card = data[0]
    assert card["object"] == "model" and card["id"] == TINY_PRESET_NAME
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card["vocab_size"] == 259  # the byte-level tokenizer: 256 bytes + 3 specials


def test_completion_reports_usage_and_length_finish(client, model):
    resp = client.completions.create(model=model, prompt="Hello, world", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens == len("Hello, world".encode())  # one token per byte
    assert resp.model == TINY_PRESET_NAME
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8


def test_completion_accepts_token_id_prompts(client, model):
    ids = [40, 41, 42, 43, 44]
    flat = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    nested = client.completions.create(model=model, prompt=[ids], max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert flat.usage.prompt_tokens == len(ids)
    assert flat.choices[0].text == nested.choices[0].text


def test_default_alias_names_the_served_model(client):
    resp = client.completions.create(model="default", prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2
    assert resp.model == TINY_PRESET_NAME


def test_streamed_completion_matches_non_streamed_and_ends_with_usage(client, model):
    kwargs = dict(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_is_sse_terminated_by_done(server, model):
    body = {"model": model, "prompt": "abc", "max_tokens": 5, "stream": True, "ignore_eos": True}
    with server.http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in payloads[-1]  # only with stream_options.include_usage


def test_chat_completion_returns_assistant_message_and_usage(client, model):
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    msg = resp.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6
    assert resp.usage.prompt_tokens > 0


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_every_openai_role_the_api_accepts_is_rendered_by_the_engine(client, model, role):
    resp = client.chat.completions.create(model=model, messages=[{"role": role, "content": "x"}], max_tokens=2,
                                          extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 2


def test_min_tokens_holds_back_a_stop_token(client, model):
    # Find a prompt whose greedy first token is one ASCII byte, so its id is known (byte b is id b + 3).
    for prompt in ("abc", "hello", "xyz", "0123", "The", "aa", "zz", "Q"):
        token = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                          logprobs=1).choices[0].logprobs.tokens[0]
        if len(token) == 1 and ord(token) < 128:
            break
    else:
        pytest.fail("no prompt with an ASCII first token")
    stop = {"stop_token_ids": [3 + ord(token)]}
    stopped = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body=stop)
    held = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={**stop, "min_tokens": 4})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens >= 4


def test_logit_bias_forces_and_bans_tokens(client, model):
    def tokens_of(char):
        return str(3 + ord(char))  # byte b is token id b + 3

    def complete(bias):
        return client.completions.create(model=model, prompt="hello", max_tokens=6, temperature=0,
                                         logit_bias=bias).choices[0].text

    assert complete({tokens_of("Z"): 100}) == "ZZZZZZ"
    # The model's logits are a few units wide: -100 bans Z outright, +50 makes Y the winner.
    assert complete({tokens_of("Z"): -100, tokens_of("Y"): 50}) == "YYYYYY"
    assert "Z" not in complete({tokens_of("Z"): -100})


def test_stop_string_cuts_streamed_and_plain_text_alike(client, model):
    letters = {str(3 + ord(c)): 100 for c in "abc"}  # outputs made of a, b, c only
    kwargs = dict(model=model, prompt="stop test", max_tokens=24, temperature=0, logit_bias=letters,
                  extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[8:10]
    plain = client.completions.create(stop=stop, **kwargs).choices[0]
    assert plain.text == text[:text.index(stop)] and plain.finish_reason == "stop"
    chunks = list(client.completions.create(stop=[stop, "zz"], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=24,
                                          temperature=0, logit_bias=letters, stop=["a", "b", "c"])
    assert chat.choices[0].message.content == "" and chat.choices[0].finish_reason == "stop"
    assert chat.usage.completion_tokens == 1


def test_penalties_reach_the_sampler(client, model):
    letters = {str(3 + ord(c)): 100 for c in "abc"}  # outputs made of a, b, c only
    kwargs = dict(model=model, prompt="hello", max_tokens=6, temperature=0, logit_bias=letters)  # no a, b, c
    plain = client.completions.create(**kwargs).choices[0].text
    # A seen letter's logit (~100) is divided by 50: the next two picks must be the unseen letters.
    spread = client.completions.create(extra_body={"repetition_penalty": 50}, **kwargs).choices[0].text
    assert sorted(spread[:3]) == ["a", "b", "c"]
    fresh = client.completions.create(frequency_penalty=2, presence_penalty=2, **kwargs).choices[0].text
    # Greedy without penalties repeats one letter ("bccccc" for this model and prompt); penalties
    # of 2 + 2 per occurrence move it to another letter.
    assert max(plain.count(c) for c in "abc") >= 4
    assert fresh != plain and max(fresh.count(c) for c in "abc") < max(plain.count(c) for c in "abc")


def test_n_choices_are_seeded_apart_reproducible_and_counted_in_usage(client, model):
    kwargs = dict(model=model, prompt="choices", max_tokens=8, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    three = client.completions.create(n=3, **kwargs)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.text for c in three.choices]
    assert len(set(texts)) == 3  # choice i samples with seed + i
    assert client.completions.create(n=3, **kwargs).choices[2].text == texts[2]
    assert client.completions.create(**kwargs).choices[0].text == texts[0]
    assert three.usage.completion_tokens == 24 and three.usage.prompt_tokens == len("choices")

    streamed: dict = {}
    finishes: dict = {}
    for chunk in client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = finishes.get(c.index, []) + [c.finish_reason]
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 24
    assert [streamed[i] for i in range(3)] == texts
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}

    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=1.0, seed=7, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


def test_streamed_logprobs_match_the_non_streamed_ones_while_text_is_held_back(client, model):
    letters = {str(3 + ord(c)): 100 for c in "abc"}
    # Stop strings that begin with the output's letters make the server hold text back while it
    # streams; the offsets must count the tokens' text, not the text sent so far.
    kwargs = dict(model=model, prompt="offsets", max_tokens=10, temperature=0, logit_bias=letters, logprobs=1,
                  stop=["ab", "ca", "bb", "zz"], extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0]
    tokens, offsets, text = [], [], ""
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert text == plain.text
    assert tokens == plain.logprobs.tokens and offsets == plain.logprobs.text_offset
    assert offsets == list(range(len(tokens)))  # one character per token here


def test_streamed_chat_matches_non_streamed_and_ends_with_usage(client, model):
    kwargs = dict(model=model, messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Name a colour."}],
                  max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_logprobs_give_top_k_per_token(client, model):
    resp = client.completions.create(model=model, prompt="logprobs", max_tokens=4, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    # A lone byte of a character is `bytes:\xNN` (OpenAI's convention): the tokens rebuild the text.
    rebuilt = b"".join(bytes.fromhex(t[len("bytes:"):].replace("\\x", "")) if t.startswith("bytes:")
                       else t.encode() for t in lp.tokens)
    assert rebuilt.decode("utf-8", errors="replace") == resp.choices[0].text
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert token_lp is not None and token_lp <= 0
        assert len(top) == 3  # distinct tokens never share a key
        # greedy: the chosen token is the most likely one
        assert token_lp == pytest.approx(max(top.values()), abs=1e-5)


def test_chat_logprobs_give_top_logprobs_per_token(client, model):
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2


def test_seeded_sampling_is_reproducible(client, model):
    kwargs = dict(model=model, prompt="seed", max_tokens=16, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second


def test_min_tokens_is_passed_to_the_engine(server, model):
    # min_tokens above max_tokens is only detectable by the engine's SamplingParams check.
    resp = server.http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2,
                                                     "min_tokens": 5})
    assert resp.status_code == 400
    assert "min_tokens" in resp.json()["error"]["message"]


def test_metrics_expose_design_names_histograms_and_per_head_pages(server, client, model):
    client.completions.create(model=model, prompt="metrics", max_tokens=4, extra_body={"ignore_eos": True})
    snapshot = server.wait_idle_with_all_pages_free()
    text = server.http.get("/metrics").text
    for name in REQUIRED_METRICS:
        assert name in snapshot, name
        if name.endswith("_total") and name != "fastdeploy:kv_pages_total":
            assert f"# TYPE {name} counter" in text
    per_head = [v for k, v in snapshot.items() if k.startswith('fastdeploy:kv_pages_free_per_head{head="')]
    assert len(per_head) == 4 and '{head="0"}' in text  # the tiny preset's 4 KV heads
    assert sum(per_head) == snapshot["fastdeploy:kv_pages_free"]
    assert snapshot["fastdeploy:generation_tokens_total"] >= 4
    for hist in ("fastdeploy:time_to_first_token_seconds", "fastdeploy:time_per_output_token_seconds"):
        assert f"# TYPE {hist} histogram" in text
        assert snapshot[f"{hist}_count"] >= 1
        assert snapshot[f'{hist}_bucket{{le="+Inf"}}'] == snapshot[f"{hist}_count"]


def test_a_repeated_prompt_hits_the_prefix_cache(server, client, model):
    prompt = [3 + (i * 7) % 200 for i in range(100)]
    before = server.metrics()["fastdeploy:prefix_cache_hit_tokens_total"]
    for _ in range(2):
        client.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True})
    after = server.wait_idle_with_all_pages_free()["fastdeploy:prefix_cache_hit_tokens_total"]
    assert after - before >= 64  # the second request reused the first one's full blocks


def test_an_idle_engines_metrics_count_a_request_that_ran_in_one_step(server, client, model):
    """A request added and finished within one engine step leaves the engine idle as it found it; its
    counters must still be in the snapshot the idle engine shows (not half a second later)."""
    server.wait_idle_with_all_pages_free()
    time.sleep(0.6)  # the idle engine has just published its periodic snapshot
    before = server.metrics()["fastdeploy:prompt_tokens_total"]
    out = client.completions.create(model=model, prompt=[5, 6, 7, 8, 9], max_tokens=1)
    snapshot = server.wait_idle_with_all_pages_free()
    assert snapshot["fastdeploy:prompt_tokens_total"] - before == out.usage.prompt_tokens == 5


def test_render_gives_the_ids_the_request_runs_on(server, model):
    """vLLM's render routes (what vllm-router's kv_aware matches against KV-cache events): the ids a completion
    or chat body becomes are exactly the prompt the engine then runs (its usage counts them)."""
    chat = {"model": model, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Name a colour."}]}
    rendered = server.http.post("/v1/chat/completions/render", json=chat).json()["token_ids"]
    ran = server.http.post("/v1/chat/completions", json={**chat, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert len(rendered) == ran and rendered == server.http.post("/tokenize", json=chat).json()["tokens"]
    many = server.http.post("/v1/completions/render", json={"model": model, "prompt": ["one prompt", "and another"]})
    assert [len(r["token_ids"]) for r in many.json()] == [
        server.http.post("/v1/completions", json={"prompt": p, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
        for p in ("one prompt", "and another")]
    ids = server.http.post("/v1/completions/render", json={"prompt": [5, 6, 7]}).json()
    assert ids == [{"token_ids": [5, 6, 7]}]
    bad = server.http.post("/v1/completions/render", json={"prompt": 5})
    assert bad.status_code == 400 and bad.json()["error"]["message"]


def test_metrics_port_serves_metrics_but_not_the_api(server):
    snapshot = server.metrics(port=server.metrics_port)
    assert "fastdeploy:kv_pages_total" in snapshot
    resp = server.http.post(f"http://127.0.0.1:{server.metrics_port}/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 404
    assert resp.json()["error"]["message"]

"""vLLM's tokenizer routes, names and shapes: POST /tokenize (prompt or messages), POST /detokenize,
GET /tokenizer_info; behind --api-key and the body limit like every /v1 route; bad input is a 400.
The ids are the ones the engine runs: a tokenized prompt sent as token ids gets the same completion
as the text."""

import pytest

KEY = "tok-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--api-key", KEY, "--max-request-body-bytes", str(BODY_LIMIT))


def test_tokenize_a_prompt_gives_tokens_count_and_max_model_len(server):
    body = server.http.post("/tokenize", json={"prompt": "Hello"}, headers=AUTH).json()
    assert set(body) == {"tokens", "count", "max_model_len"}
    assert body["tokens"] == [b + 3 for b in b"Hello"] and body["count"] == 5  # the preset's byte ids
    models = server.http.get("/v1/models", headers=AUTH).json()["data"][0]
    assert body["max_model_len"] == models["max_model_len"]
    strs = server.http.post("/tokenize", json={"prompt": "Hi", "return_token_strs": True}, headers=AUTH).json()
    assert len(strs["token_strs"]) == 2


def test_tokenized_prompt_runs_as_the_text_does(server):
    ids = server.http.post("/tokenize", json={"prompt": "The same prompt"}, headers=AUTH).json()["tokens"]
    common = {"max_tokens": 4, "temperature": 0}
    by_text = server.http.post("/v1/completions", json={"prompt": "The same prompt", **common}, headers=AUTH).json()
    by_ids = server.http.post("/v1/completions", json={"prompt": ids, **common}, headers=AUTH).json()
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"]
    assert by_text["usage"]["prompt_tokens"] == len(ids)


def test_tokenize_messages_counts_the_chat_prompt(server):
    messages = [{"role": "user", "content": "Hi there"}]
    body = server.http.post("/tokenize", json={"messages": messages}, headers=AUTH).json()
    chat = server.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, headers=AUTH).json()
    assert body["count"] == chat["usage"]["prompt_tokens"] == len(body["tokens"])
    without = server.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False},
                               headers=AUTH).json()
    assert without["count"] < body["count"]


def test_detokenize_inverts_tokenize(server):
    text = "round trip: é"
    ids = server.http.post("/tokenize", json={"prompt": text}, headers=AUTH).json()["tokens"]
    assert server.http.post("/detokenize", json={"tokens": ids}, headers=AUTH).json() == {"prompt": text}


def test_tokenizer_info_names_the_special_tokens(server):
    info = server.http.get("/tokenizer_info", headers=AUTH).json()
    assert {"eos_token", "bos_token", "pad_token", "chat_template", "model_max_length"} <= set(info)
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert info["chat_template"] is None  # the preset renders a plain transcript, no Jinja template
    assert info["model_max_length"] == server.http.get("/v1/models", headers=AUTH).json()["data"][0]["max_model_len"]


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
    ("GET", "/tokenizer_info", None)])
def test_tokenizer_routes_need_the_api_key(server, helpers, method, path, body):
    err = helpers.assert_openai_error(server.http.request(method, path, json=body), 401)
    assert err["code"] == "invalid_api_key"
    wrong = server.http.request(method, path, json=body, headers={"Authorization": "Bearer nope"})
    helpers.assert_openai_error(wrong, 401)


def test_tokenize_body_over_the_limit_is_413(server, helpers):
    helpers.assert_openai_error(server.http.post("/tokenize", json={"prompt": "x" * 2 * BODY_LIMIT}, headers=AUTH),
                                413)


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, None),                                                   # neither prompt nor messages
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),  # both
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages.0.role"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),                       # past the vocabulary
    ("/detokenize", {"tokens": [1, True]}, "tokens.1"),
])
def test_bad_tokenizer_input_is_a_400(server, helpers, path, body, param):
    helpers.assert_openai_error(server.http.post(path, json=body, headers=AUTH), 400, param)


def test_non_json_body_is_a_400(server, helpers):
    resp = server.http.post("/tokenize", content=b"not json", headers={**AUTH, "Content-Type": "application/json"})
    helpers.assert_openai_error(resp, 400)

"""`fastdeploy serve`, no --model: the real SmolLM2-135M-Instruct (fetched on first use) answers a factual
chat question correctly over real HTTP, streams the same text, and completes a raw prompt."""

import json

import pytest

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`


@pytest.fixture(scope="module")
def server(server_factory):
    # The base flags squeeze the cache for the tiny preset; 64 blocks of 16 tokens hold a short chat.
    return server_factory("--max-model-len", "512", env={"FD_HEAD_WISE_KV_CACHE": "0"},
                          entry=("-m", "fastdeploy.cli", "serve"))


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_chat_answers_a_factual_question_with_real_text(server):
    resp = server.http.post("/v1/chat/completions", json={"model": server.model_name(), "messages": QUESTION,
                                                           "max_tokens": 24, "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"  # <|im_end|> ends the turn


def test_streamed_chat_gives_the_same_answer(server):
    plain = server.http.post("/v1/chat/completions", json={"model": server.model_name(), "messages": QUESTION,
                                                            "max_tokens": 24, "temperature": 0}).json()
    text = ""
    with server.http.stream("POST", "/v1/chat/completions", json={
            "model": server.model_name(), "messages": QUESTION, "max_tokens": 24, "temperature": 0,
            "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    assert text == plain["choices"][0]["message"]["content"]


def test_completion_continues_a_raw_prompt_in_english(server):
    resp = server.http.post("/v1/completions", json={"model": server.model_name(),
                                                      "prompt": "The three primary colors are", "max_tokens": 16,
                                                      "temperature": 0})
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["text"]
    assert any(color in text for color in ("red", "blue", "green", "yellow")), text


CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
    "population_millions": {"type": "number"}, "is_capital": {"type": "boolean"}},
    "required": ["city", "country", "population_millions", "is_capital"], "additionalProperties": False}


def test_json_schema_chat_answer_conforms_on_the_real_model(server):
    """Structured outputs through SmolLM2's own GGUF vocabulary (llguidance built from its token bytes)."""
    import jsonschema
    resp = server.http.post("/v1/chat/completions", json={
        "model": server.model_name(), "max_tokens": 80, "temperature": 0,
        "messages": [{"role": "user", "content": "Give facts about Paris as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # the grammar let <|im_end|> end the turn once the object closed
    answer = json.loads(choice["message"]["content"])
    jsonschema.validate(answer, CITY)
    assert answer["city"] == "Paris"

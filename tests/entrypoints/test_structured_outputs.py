"""Structured outputs over real HTTP: response_format json_schema / json_object and upstream's
guided_json / guided_regex / guided_choice / guided_grammar, on chat and completions.

The tiny preset has random weights, so unconstrained it writes byte soup: every conforming answer
below is the grammar's doing (the same requests without it fail these checks). The server runs
n-gram speculation, so every test also drafts under a grammar; one test compares its outputs with
plain decoding (no speculation) token for token.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema  # the test extra installs it: a missing one must fail, not skip the file
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.guided_decoding import GuidedDecodingParams

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# Never off (disable_by_batch_size null): the batch test drafts too.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": None}
MAX_TOKENS = 160

# Bounded so random weights finish (strings have maxLength, arrays maxItems, numbers a range).
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "member": {"type": "boolean"},
    "role": {"enum": ["admin", "user", "guest"]},
}, "required": ["name", "age", "member", "role"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": -50, "maximum": 50},
    "owner": PERSON,
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
               "maxItems": 4},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "ok": {"type": "boolean"},
}, "required": ["id", "owner", "scores", "tags", "ok"], "additionalProperties": False}
LIST_OF_OBJECTS = {"type": "array", "items": {"type": "object", "properties": {
    "x": {"type": "integer", "minimum": 0, "maximum": 99}, "flag": {"type": "boolean"}},
    "required": ["x", "flag"], "additionalProperties": False}, "minItems": 1, "maxItems": 3}
SCHEMAS = {"person": PERSON, "nested": NESTED, "list_of_objects": LIST_OF_OBJECTS}
MESSAGES = [{"role": "user", "content": "Describe the record as JSON."}]
# Byte tokenizer ids (byte + 3) of '"' and '}': pushed up so random weights close what they open
# (a free string or nesting could otherwise run past max_tokens); the grammar still decides what is legal.
CLOSERS = {"37": 12, "128": 6}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--max-model-len", "512", "--speculative-config", json.dumps(SPEC))


def _chat(server, **body) -> list:
    resp = server.http.post(CHAT, json={"messages": MESSAGES, "max_tokens": MAX_TOKENS, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"]


def _complete(server, **body) -> list:
    resp = server.http.post(COMPLETIONS, json={"prompt": "record:", "max_tokens": MAX_TOKENS, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"]


def _conforms(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("temperature", [0, 1.0])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_json_schema_answer_parses_and_validates(server, name, temperature):
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    choices = _chat(server, response_format=fmt, temperature=temperature, n=3, seed=7)
    choices += _complete(server, guided_json=schema, temperature=temperature, n=3, seed=11)
    for choice in choices:
        assert choice["finish_reason"] == "stop", choice
        _conforms(choice["message"]["content"] if "message" in choice else choice["text"], schema)


def test_without_a_constraint_the_random_model_does_not_write_json(server):
    """The conformance here is the grammar's work: the same requests unconstrained are not JSON."""
    for bias in (None, CLOSERS):
        text = _complete(server, temperature=0, max_tokens=40, logit_bias=bias)[0]["text"]
        with pytest.raises(ValueError):
            json.loads(text)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_object_gives_a_json_object(server, temperature):
    choices = _chat(server, response_format={"type": "json_object"}, temperature=temperature, n=2, seed=3,
                    logit_bias=CLOSERS)
    choices += _complete(server, guided_json_object=True, temperature=temperature, seed=5, logit_bias=CLOSERS)
    for choice in choices:
        assert choice["finish_reason"] == "stop", choice
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert isinstance(json.loads(text), dict), text


def test_guided_choice_gives_one_of_the_choices(server):
    options = ["positive", "negative", "neutral", "not sure"]
    choices = _chat(server, guided_choice=options, temperature=1.0, n=6, seed=1)
    choices += _complete(server, guided_choice=options, temperature=0)
    assert all(c.get("text", (c.get("message") or {}).get("content")) in options for c in choices), choices


def test_guided_regex_matches(server):
    pattern = r"[A-Z]{2}-[0-9]{3,5}( \(v[0-9]\))?"
    choices = _complete(server, guided_regex=pattern, temperature=1.0, n=4, seed=2)
    choices += _chat(server, guided_regex=pattern, temperature=0)
    for choice in choices:
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert re.fullmatch(pattern, text), text


# Lark with rules, alternatives and nesting (kept finite, so random weights finish), and llama.cpp's GBNF.
LARK = 'start: "(" expr ")" | expr\nexpr: term op term\nterm: /[0-9]{1,2}/ | "(" /[0-9]/ op /[0-9]/ ")"\nop: "+" | "*"\n'
_TERM = r"([0-9]{1,2}|\([0-9][+*][0-9]\))"
LARK_LANGUAGE = rf"\({_TERM}[+*]{_TERM}\)|{_TERM}[+*]{_TERM}"
GBNF = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c] [0-9]?\n'


def test_guided_grammar_lark_and_gbnf_conform(server):
    for choice in _complete(server, guided_grammar=LARK, temperature=1.0, n=4, seed=9, max_tokens=200):
        assert choice["finish_reason"] == "stop" and re.fullmatch(LARK_LANGUAGE, choice["text"]), choice
    for choice in _chat(server, guided_grammar=GBNF, temperature=1.0, n=4, seed=9, max_tokens=200):
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop" and re.fullmatch(r"\[[a-c][0-9]?(,[a-c][0-9]?)*\]", text), choice


BROKEN = [
    ("json_schema_unknown_type", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, "objec"),
    ("json_schema_dangling_ref", COMPLETIONS, {"guided_json": {"$ref": "#/$defs/missing"}}, "missing"),
    ("json_schema_bad_pattern", COMPLETIONS, {"guided_json": {"type": "string", "pattern": "(("}}, "unclosed"),
    ("json_schema_not_json", COMPLETIONS, {"guided_json": "{not json"}, "guided_json"),
    ("regex_unclosed_group", COMPLETIONS, {"guided_regex": "(ab"}, "unclosed group"),
    ("grammar_unknown_rule", CHAT, {"guided_grammar": "start: item\n"}, "item"),
    ("empty_choice_list", COMPLETIONS, {"guided_choice": []}, "guided_choice"),
    ("two_constraints", COMPLETIONS, {"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
    ("unknown_response_format", CHAT, {"response_format": {"type": "xml"}}, "response_format"),
]


@pytest.mark.parametrize("path,extra,named", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_a_constraint_that_cannot_compile_is_a_400_naming_the_problem(server, helpers, path, extra, named):
    body = {"messages": MESSAGES} if path == CHAT else {"prompt": "x"}
    resp = server.http.post(path, json={**body, "max_tokens": 4, **extra})
    error = helpers.assert_openai_error(resp, 400)
    assert named in error["message"], error
    server.assert_still_serves()


def test_constrained_and_free_requests_share_a_batch(server):
    """Eight at once, half under a schema: each constrained answer conforms and each free one is the
    text it gets alone (the masks of its neighbours never touch its row)."""
    free_prompts = [f"free text {i}" for i in range(4)]
    alone = [_complete(server, prompt=p, temperature=0, max_tokens=24)[0]["text"] for p in free_prompts]

    def run(i):
        if i % 2:
            return _complete(server, prompt=f"record {i}:", guided_json=NESTED, temperature=0.8, seed=i)[0]
        return _complete(server, prompt=free_prompts[i // 2], temperature=0, max_tokens=24)[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for i, choice in enumerate(results):
        if i % 2:
            _conforms(choice["text"], NESTED)
        else:
            assert choice["text"] == alone[i // 2]


def test_streamed_json_schema_answer_conforms(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "nested", "schema": NESTED}}
    text = ""
    with server.http.stream("POST", CHAT, json={"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.7,
                                                "seed": 4, "response_format": fmt, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                text += (choices[0]["delta"].get("content") or "") if choices else ""
    _conforms(text, NESTED)


# A prompt that repeats what the grammar makes the model write: the n-gram proposer drafts from it.
REPEATING = 'record: {"id":1,"owner":{"name":"ab","age":3,"member":true,"role":"user"},"scores":[1,2],"tags":[],' \
            '"ok":true} {"id":1,"owner":{"name":"ab","age":3,"member":true,"role":"user"},"scores":[1,2]'


def test_outputs_under_a_grammar_are_the_same_with_speculation_on_and_off(server):
    params = [("json", NESTED), ("regex", r"(ab|cd){2,6}-[0-9]+"), ("choice", ["alpha beta", "alpha gamma"])]
    before = server.metrics()["fastdeploy:spec_decode_num_draft_tokens_total"]
    served = [_complete(server, prompt=REPEATING, temperature=0, **{f"guided_{k}": v})[0]["text"] for k, v in params]
    assert server.metrics()["fastdeploy:spec_decode_num_draft_tokens_total"] > before  # drafts were verified

    llm = LLM(block_size=16, max_model_len=512, num_gpu_blocks_override=64)  # no speculation
    plain = [llm.generate([REPEATING], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                      guided_decoding=GuidedDecodingParams(**{k: v})),
                          use_tqdm=False)[0].outputs.text for k, v in params]
    assert served == plain


def test_the_official_openai_client_parses_a_pydantic_answer(server):
    """openai's `chat.completions.parse` sends the model's JSON schema (strict) and reads the answer back
    into the class: what a user of the official client writes."""
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=120)
        member: bool

    done = server.openai_client().chat.completions.parse(
        model=server.model_name(), messages=MESSAGES, response_format=Person, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"logit_bias": CLOSERS})
    person = done.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120 and len(person.name) <= 8


def test_with_guided_decoding_off_a_constrained_request_is_a_400_and_free_ones_run(server_factory):
    off = server_factory("--max-model-len", "256", "--guided-decoding-backend", "off")
    resp = off.http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    assert resp.status_code == 400, resp.text
    assert "--guided-decoding-backend off" in resp.json()["error"]["message"]
    free = off.http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 8})
    assert free.status_code == 200 and free.json()["choices"][0]["finish_reason"] in ("length", "stop")

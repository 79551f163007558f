"""A server started with --api-key and --max-request-body-bytes: every /v1/* route needs a key
(401 in OpenAI's error format otherwise), /health, /metrics and /version stay open, large bodies
get 413."""

from __future__ import annotations

import pytest

from fastdeploy.entrypoints.openai.access_control import resolve_api_keys

KEYS = ("key-one", "a-second-longer-key")
BODY_LIMIT = 4096
V1_ROUTES = (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
             ("GET", "/v1/no-such-route"))
SMALL_COMPLETION = {"prompt": "ok", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--api-key", KEYS[0], "--api-key", KEYS[1],
                          "--max-request-body-bytes", str(BODY_LIMIT))


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _body_for(path: str) -> dict | None:
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": "ok"}], "max_tokens": 2}
    return SMALL_COMPLETION if path == "/v1/completions" else None


@pytest.mark.parametrize("method, path", V1_ROUTES)
@pytest.mark.parametrize("headers", [{}, _auth("wrong"), _auth(KEYS[0] + "x"), {"Authorization": KEYS[0]}],
                         ids=["no header", "wrong key", "key with a suffix", "no Bearer scheme"])
def test_v1_routes_reject_a_missing_or_wrong_key_with_openai_401(server, helpers, method, path, headers):
    resp = server.http.request(method, path, json=_body_for(path), headers=headers)
    err = helpers.assert_openai_error(resp, 401)
    assert err["code"] == "invalid_api_key"
    assert resp.headers["www-authenticate"] == "Bearer"
    assert KEYS[0] not in resp.text and KEYS[1] not in resp.text


@pytest.mark.parametrize("key", KEYS)
def test_each_configured_key_opens_the_v1_routes(server, key):
    resp = server.http.post("/v1/completions", json=SMALL_COMPLETION, headers=_auth(key))
    assert resp.status_code == 200, resp.text
    assert server.http.get("/v1/models", headers=_auth(key)).status_code == 200


def test_openai_client_with_the_key_works_and_without_it_gets_authentication_error(server):
    import openai

    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[1], max_retries=0) as good:
        out = good.completions.create(model="default", prompt="ok", max_tokens=2)
        assert out.usage.completion_tokens >= 1
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="default", prompt="ok", max_tokens=2)


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_health_metrics_and_version_stay_open_without_a_key(server, path):
    assert server.http.get(path).status_code == 200


def test_body_over_the_limit_gets_413_before_it_is_read(server, helpers):
    body = {**SMALL_COMPLETION, "prompt": "x" * (BODY_LIMIT + 1)}
    resp = server.http.post("/v1/completions", json=body, headers=_auth(KEYS[0]))
    err = helpers.assert_openai_error(resp, 413)
    assert str(BODY_LIMIT) in err["message"]


def test_chunked_body_over_the_limit_gets_413(server, helpers):
    def chunks():  # no Content-Length: the limit is enforced while the body streams in
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 512 + 1):
            yield b"y" * 512
        yield b'", "max_tokens": 2}'

    resp = server.http.post("/v1/completions", content=chunks(),
                            headers={**_auth(KEYS[0]), "Content-Type": "application/json"})
    helpers.assert_openai_error(resp, 413)
    server.http.post("/v1/completions", json=SMALL_COMPLETION, headers=_auth(KEYS[0])).raise_for_status()


def test_body_under_the_limit_is_served(server):
    body = {**SMALL_COMPLETION, "prompt": "z " * 200}
    resp = server.http.post("/v1/completions", json=body, headers=_auth(KEYS[0]))
    assert resp.status_code == 200, resp.text


def test_cli_keys_win_over_fd_api_key_and_empty_keys_do_not_count(monkeypatch):
    from fastdeploy import envs

    monkeypatch.setenv("FD_API_KEY", "env-a, env-b,,")
    assert resolve_api_keys(None, envs.FD_API_KEY) == ["env-a", "env-b"]
    assert resolve_api_keys(["cli"], envs.FD_API_KEY) == ["cli"]
    assert resolve_api_keys([""], []) == []
    monkeypatch.setenv("FD_API_KEY", "")
    assert resolve_api_keys(None, envs.FD_API_KEY) == []


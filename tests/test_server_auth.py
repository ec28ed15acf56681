"""The key is checked before the body is read: no key means 401 whatever the body
(never 400 or 413), on inference and admin routes alike; the user key on an admin
route is 403. /health is open; /metrics and the API docs need the key unless
--public-metrics / --public-docs open them. In-process, over no engine."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from metrale.cli import build_parser
from metrale.server.app import create_app
from metrale.server.metrics import ServerMetrics
from metrale.server.settings import ServerSettings

USER, ADMIN = "user-key", "admin-key"
AUTH = {"Authorization": f"Bearer {USER}"}

ADMIN_ROUTES = [("POST", "/v1/adapters"), ("POST", "/v1/adapters/a/promote"),
                ("POST", "/v1/adapters/a/swap"), ("POST", "/v1/adapters/a/pin"),
                ("POST", "/v1/adapters/a/unpin"), ("DELETE", "/v1/adapters/a"),
                ("POST", "/v1/lora/active"), ("POST", "/v1/lora/load"),
                ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")]
USER_ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
               ("GET", "/v1/models"), ("GET", "/v1/adapters"), ("GET", "/v1/lora/active")]
DOCS = ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"]


def stub_app(**settings_kw) -> TestClient:
    """The app over no engine (its lifespan is not run): enough for every check that
    happens before a route reaches the engine."""
    stub = SimpleNamespace(metrics=ServerMetrics(), alive=False, error=None)
    kw = {"model_id": "m", "api_key": USER, "admin_key": ADMIN, "max_body_bytes": 1024,
          **settings_kw}
    return TestClient(create_app(stub, ServerSettings(**kw)))


@pytest.mark.parametrize("method, path", ADMIN_ROUTES + USER_ROUTES)
def test_no_key_is_401_whatever_the_body(method, path):
    client = stub_app()
    bodies = [b"{not json", b"x" * 4096, json.dumps({"temperature": math.nan}).encode(), b""]
    for body in bodies:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
            r = client.request(method, path, content=body, headers={
                **headers, "Content-Type": "application/json"})
            assert r.status_code == 401, (method, path, body[:10], r.text)
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("method, path", ADMIN_ROUTES)
def test_the_user_key_is_403_on_admin_routes_whatever_the_body(method, path):
    client = stub_app()
    for body in (b"{not json", b"x" * 4096):
        r = client.request(method, path, content=body, headers={**AUTH,
                                                                "Content-Type": "application/json"})
        assert r.status_code == 403, (method, path, r.text)


def test_with_the_key_the_body_is_judged():
    client = stub_app()
    headers = {**AUTH, "Content-Type": "application/json"}
    r = client.post("/v1/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert client.post("/v1/completions", content=b"x" * 4096, headers=headers).status_code == 413
    admin = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
    assert client.post("/v1/adapters", content=b"{not json", headers=admin).status_code == 400
    assert client.get("/v1/lora/active", headers=AUTH).status_code == 200  # a read, not admin
    refusals = client.get("/metrics", headers=AUTH).text
    assert 'metrale_refusals_total{reason="RequestValidationError"}' in refusals


def test_unknown_paths_need_the_key_too():
    client = stub_app()
    assert client.get("/nope").status_code == 401
    assert client.get("/nope", headers=AUTH).status_code == 404


def test_metrics_and_docs_need_the_key():
    client = stub_app()
    assert client.get("/health").status_code == 503  # open: it says the (stub) engine is down
    for path in ["/metrics", *DOCS]:
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=AUTH).status_code == 200, path
    text = client.get("/metrics", headers=AUTH).text
    assert 'metrale_refusals_total{reason="AuthenticationError"}' in text


def test_public_flags_open_metrics_and_docs_only():
    client = stub_app(public_metrics=True)
    assert client.get("/metrics").status_code == 200
    assert all(client.get(path).status_code == 401 for path in DOCS)
    client = stub_app(public_docs=True)
    assert client.get("/metrics").status_code == 401
    assert all(client.get(path).status_code == 200 for path in DOCS)
    client = stub_app(public_metrics=True, public_docs=True)
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401


def test_without_an_api_key_metrics_and_docs_are_open():
    client = stub_app(api_key=None)
    for path in ["/metrics", *DOCS]:
        assert client.get(path).status_code == 200, path
    assert client.post("/v1/adapters/a/pin").status_code == 401  # the admin key still guards


def test_serve_flags(capsys):
    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert not args.public_metrics and not args.public_docs
    args = parser.parse_args(["serve", "--public-metrics", "--public-docs"])
    assert args.public_metrics and args.public_docs
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "--public-metrics" in help_text and "--public-docs" in help_text

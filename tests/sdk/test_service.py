"""Service routes: /healthz, /v1/openapi.json, auth, /v1/me, /v1/templates, /v1/volumes."""

import json
import pathlib

import pytest
import requests

from pandastack import AuthError, Client

OPENAPI = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api" / "openapi.json"


def test_healthz_answers_without_a_token(shoal):
    r = requests.get(f"{shoal.url}/healthz", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_openapi_document_is_served_as_committed(shoal):
    r = requests.get(f"{shoal.url}/v1/openapi.json", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == json.loads(OPENAPI.read_text())


def test_api_without_a_valid_token_is_401_json(shoal):
    r = requests.get(f"{shoal.url}/v1/sandboxes", timeout=10)
    assert r.status_code == 401
    assert isinstance(r.json()["error"], str) and r.json()["error"]
    with pytest.raises(AuthError):
        Client(api_url=shoal.url, api_key="not-a-shoal-token").sandboxes.list()


def test_me_names_the_tokens_account_and_tier(client, account):
    me = client.me()
    assert me["account"] == account.name
    assert me["tier"] == "team"
    assert isinstance(me["limits"]["max_concurrent_sandboxes"], int)
    assert isinstance(me["limits"]["max_creates_per_hour"], int)


def test_templates_list_has_the_first_party_templates(client):
    templates = {t.name: t for t in client.templates.list()}
    assert {"base", "code-interpreter"} <= set(templates)
    for name in ("base", "code-interpreter"):
        assert isinstance(templates[name].cpu, int) and templates[name].cpu > 0
        assert isinstance(templates[name].memory_mb, int) and templates[name].memory_mb > 0


def test_volumes_list_of_a_fresh_account_is_empty(shoal, make_account):
    fresh = make_account("free", "volumes")
    assert shoal.client(fresh.token).volumes.list() == []

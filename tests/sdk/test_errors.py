"""Every error is {"error": "..."}; bad input is a 4xx with a message, never a 500."""

import pytest

from pandastack import BadRequestError
from sdkhelpers import error_of


@pytest.fixture(scope="module")
def sb(module_sandboxes):
    return module_sandboxes(metadata={"suite": "sdk-errors"})


def live_ids(http, shoal):
    return {s["id"] for s in http.get(f"{shoal.url}/v1/sandboxes", timeout=30).json()["items"]}


def test_malformed_json_is_400(shoal, http):
    before = live_ids(http, shoal)
    r = http.post(f"{shoal.url}/v1/sandboxes", data=b'{"template": "base",',
                  headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400
    error_of(r)
    assert live_ids(http, shoal) == before


@pytest.mark.parametrize("body", [
    {"template": 5},
    {"template": "base", "ttl_seconds": "ten"},
    {"template": "base", "ttl_seconds": 1.5},
    {"template": "base", "persistent": "yes"},
    {"template": "base", "metadata": {"k": 1}},
    {"template": "base", "metadata": ["k"]},
    {"template": "base", "volumes": "data"},
    [{"template": "base"}],
])
def test_fields_of_the_wrong_type_are_400(shoal, http, body):
    before = live_ids(http, shoal)
    r = http.post(f"{shoal.url}/v1/sandboxes", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error_of(r)
    assert live_ids(http, shoal) == before


def test_negative_ttl_is_400(client, sb):
    with pytest.raises(BadRequestError) as refused:
        client.sandboxes.create(template="base", ttl_seconds=-5)
    assert "ttl" in str(refused.value).lower()
    with pytest.raises(BadRequestError):
        sb.set_ttl(-5)


@pytest.mark.parametrize("template", ["no-such-template", "../base", "BASE", ""])
def test_bad_template_name_is_400(client, template):
    with pytest.raises(BadRequestError) as refused:
        client.sandboxes.create(template=template)
    assert str(refused.value).strip()


@pytest.mark.parametrize("body", [{}, {"cmd": 5}, {"cmd": ""}, {"cmd": "true", "timeout_seconds": "soon"},
                                  {"cmd": "true", "timeout_seconds": -1}])
def test_bad_exec_bodies_are_400(shoal, http, sb, body):
    r = http.post(f"{shoal.url}/v1/sandboxes/{sb.id}/exec", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error_of(r)


def test_bad_fork_tree_count_is_400(shoal, http, sb):
    for count in (0, 17, "two"):
        r = http.post(f"{shoal.url}/v1/sandboxes/{sb.id}/fork-tree", json={"count": count}, timeout=30)
        assert r.status_code == 400, (count, r.text)
        error_of(r)


def test_unknown_routes_and_methods_are_json(shoal, http):
    r = http.get(f"{shoal.url}/v1/no-such-route", timeout=30)
    assert r.status_code == 404
    error_of(r)
    r = http.put(f"{shoal.url}/v1/sandboxes", json={}, timeout=30)
    assert r.status_code == 405
    error_of(r)


def test_unknown_fields_are_ignored(client, sandboxes, shoal, http):
    r = http.post(f"{shoal.url}/v1/sandboxes", json={"template": "base", "from_the_future": {"x": 1}}, timeout=60)
    assert r.status_code == 201, r.text
    sandboxes.track(client.sandboxes.get(r.json()["id"]))

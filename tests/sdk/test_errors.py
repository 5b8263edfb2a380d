"""Every error is {"error": "..."}; bad input is a 4xx with a message, never a 500."""

import json

import pytest

from pandastack import BadRequestError
from sdkhelpers import error_of

MAX_JSON_BODY = 1 << 20


@pytest.fixture(scope="module")
def sb(module_sandboxes):
    return module_sandboxes(metadata={"suite": "sdk-errors"})


def live_ids(http, shoal):
    body = http.get(f"{shoal.url}/v1/sandboxes", timeout=30).json()
    return {s["id"] for s in (body["items"] if isinstance(body, dict) else body)}  # either shape the SDK reads


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


def test_fork_metadata_keys_are_refused_and_nothing_is_made(client, shoal, http, sb):
    """Keys starting `fork_` are the server's (fork_parent_id, fork_tree_id): a
    client that sends one gets a 400 naming it, on create, fork and fork-tree."""
    before = live_ids(http, shoal)
    r = http.post(f"{shoal.url}/v1/sandboxes", json={"template": "base", "metadata": {"ok": "1", "fork_x": "1"}},
                  timeout=60)
    assert r.status_code == 400, r.text
    assert "fork_x" in error_of(r)
    with pytest.raises(BadRequestError) as refused:
        client.sandboxes.create(template="base", metadata={"fork_parent_id": "sb-forged"})
    assert "fork_parent_id" in str(refused.value)

    for route, body in (("fork", {"metadata": {"fork_x": "1"}}),
                        ("fork-tree", {"count": 2, "metadata": {"fork_tree_id": "tree-forged"}})):
        r = http.post(f"{shoal.url}/v1/sandboxes/{sb.id}/{route}", json=body, timeout=60)
        assert r.status_code == 400, (route, r.text)
        assert next(iter(body["metadata"])) in error_of(r)
    with pytest.raises(BadRequestError) as refused:
        sb.fork(metadata={"fork_x": "1"})
    assert "fork_x" in str(refused.value)
    with pytest.raises(BadRequestError):
        sb.fork_tree(2, metadata={"fork_parent_id": sb.id})
    assert live_ids(http, shoal) == before


def padded_create(size: int) -> bytes:
    """A create body of exactly `size` bytes (an unknown field pads it; unknown fields are ignored)."""
    shell = json.dumps({"template": "base", "padding": ""}).encode()
    body = json.dumps({"template": "base", "padding": "x" * (size - len(shell))}).encode()
    assert len(body) == size
    return body


def test_a_json_body_over_1_mib_is_413_and_creates_nothing(client, shoal, account, http, sandboxes):
    before = live_ids(http, shoal)
    session = shoal.http(account.token)
    headers = {"Content-Type": "application/json"}
    too_big = padded_create(MAX_JSON_BODY + 1)
    r = session.post(f"{shoal.url}/v1/sandboxes", data=too_big, headers=headers, timeout=60)
    assert r.status_code == 413, r.text[:200]
    assert error_of(r)
    # Without a Content-Length (chunked), the limit stops the read.
    chunks = (too_big[i:i + 65536] for i in range(0, len(too_big), 65536))
    r = session.post(f"{shoal.url}/v1/sandboxes", data=chunks, headers=headers, timeout=60)
    assert r.status_code == 413, r.text[:200]
    assert error_of(r)
    # The session goes on: the refused body does not poison the next request.
    assert session.get(f"{shoal.url}/v1/sandboxes", timeout=30).status_code == 200
    with pytest.raises(BadRequestError):
        client.sandboxes.create(template="base", metadata={"pad": "x" * MAX_JSON_BODY})
    assert live_ids(http, shoal) == before

    # Exactly 1 MiB is still a body.
    r = session.post(f"{shoal.url}/v1/sandboxes", data=padded_create(MAX_JSON_BODY), headers=headers, timeout=60)
    assert r.status_code == 201, r.text[:200]
    sandboxes.track(client.sandboxes.get(r.json()["id"]))


def test_an_exec_body_over_1_mib_is_413_and_runs_nothing(shoal, account, sb):
    session = shoal.http(account.token)
    cmd = "touch /tmp/ran-413; : " + "x" * MAX_JSON_BODY
    for route in ("exec", "exec/stream"):
        r = session.post(f"{shoal.url}/v1/sandboxes/{sb.id}/{route}", json={"cmd": cmd}, timeout=60)
        assert r.status_code == 413, (route, r.text[:200])
        assert error_of(r)
    with pytest.raises(BadRequestError):
        sb.exec(cmd)
    assert not sb.filesystem.exists("/tmp/ran-413")
    assert sb.exec("echo fine").stdout == "fine\n"

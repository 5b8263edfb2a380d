"""The idle reaper against a server that looks every second (`--reap-interval 1`):
an idle sandbox goes after its ttl_seconds; a silent exec still running keeps it;
persistent sandboxes stay; max_lifetime_seconds is a hard limit."""

import threading
import time

import pytest

from pandastack import NotFoundError


@pytest.fixture(scope="module")
def reaping_server():
    from conftest import ShoalServer, _state_dir, sqlite_url, tmp_root

    server = ShoalServer(
        "shoal-reaper", _state_dir("-reaper"), sqlite_url(tmp_root() / "reaper.db"),
        extra_args=("--reap-interval", "1"),
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reaper_token(reaping_server):
    return reaping_server.create_token("sdk-reaper", "team")


def gone(client, sandbox_id):
    # The list, not a GET of the sandbox: a GET is activity and would keep it alive.
    return sandbox_id not in {s.id for s in client.sandboxes.list()}


def wait_gone(client, sandbox_id, within):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if gone(client, sandbox_id):
            return True
        time.sleep(0.5)
    return False


def test_idle_and_busy_and_persistent_sandboxes(reaping_server, reaper_token):
    client = reaping_server.client(reaper_token)
    idle = client.sandboxes.create(template="base", ttl_seconds=2)
    busy = client.sandboxes.create(template="base", ttl_seconds=2)
    keeper = client.sandboxes.create(template="base", ttl_seconds=1, persistent=True)
    try:
        outcome = {}
        # Silent for 12 s: only the exec in flight keeps the sandbox alive.
        worker = threading.Thread(target=lambda: outcome.update(result=busy.exec("sleep 12; echo done")))
        worker.start()
        assert wait_gone(client, idle.id, within=15), "an idle sandbox outlived its ttl"
        worker.join(timeout=60)
        assert outcome["result"].exit_code == 0
        assert outcome["result"].stdout.strip() == "done"
        assert not gone(client, busy.id), "a sandbox was reaped in the middle of an exec"
        # Once the exec is over it is idle like any other.
        assert wait_gone(client, busy.id, within=15)
        assert not gone(client, keeper.id), "a persistent sandbox was reaped"
    finally:
        for sandbox in (idle, busy, keeper):
            try:
                sandbox.kill()
            except NotFoundError:
                pass


def test_max_lifetime_is_a_hard_limit(reaping_server, reaper_token):
    http = reaping_server.http(reaper_token)
    r = http.post(
        f"{reaping_server.url}/v1/sandboxes",
        json={"template": "base", "persistent": True, "max_lifetime_seconds": 3},
        timeout=60,
    )
    assert r.status_code == 201, r.text
    sandbox_id = r.json()["id"]
    assert r.json()["max_lifetime_seconds"] == 3
    client = reaping_server.client(reaper_token)
    assert wait_gone(client, sandbox_id, within=15), "max_lifetime_seconds was not enforced"

"""The SDK's own capacity retry against a full host: a 503 with Retry-After that later clears.

Runs a second `shoal up` with `--max-sandboxes 1` (the `shoal_one_slot` fixture)."""

import threading
import time

import pytest

from pandastack import ServerError
from sdkhelpers import error_of


@pytest.fixture(scope="module")
def one_slot_token(shoal_one_slot):
    return shoal_one_slot.create_token("sdk-capacity", "team")


def test_a_full_host_answers_503_with_retry_after_and_creates_nothing(shoal_one_slot, one_slot_token):
    client = shoal_one_slot.client(one_slot_token, max_create_retry_seconds=0)
    http = shoal_one_slot.http(one_slot_token)
    filler = client.sandboxes.create(template="base")
    try:
        r = http.post(f"{shoal_one_slot.url}/v1/sandboxes", json={"template": "base"}, timeout=60)
        assert r.status_code == 503
        assert r.headers.get("Retry-After") == "5"
        assert error_of(r) == "no compute capacity available"
        with pytest.raises(ServerError) as refused:
            client.sandboxes.create(template="base")
        assert "no compute capacity available" in str(refused.value)
        assert [s.id for s in client.sandboxes.list()] == [filler.id]
    finally:
        filler.kill()


def test_the_sdk_retries_until_capacity_clears(shoal_one_slot, one_slot_token):
    filler = shoal_one_slot.client(one_slot_token).sandboxes.create(template="base")
    retries = []
    client = shoal_one_slot.client(one_slot_token, max_create_retry_seconds=60, on_create_retry=retries.append)
    outcome = {}

    def create() -> None:
        try:
            outcome["sandbox"] = client.sandboxes.create(template="base", metadata={"case": "retried"})
        except Exception as error:  # handed to the main thread's assertions
            outcome["error"] = error

    started = time.monotonic()
    worker = threading.Thread(target=create)
    worker.start()
    try:
        time.sleep(2)
        assert worker.is_alive(), f"the create should still be waiting for capacity: {outcome}"
        assert len(retries) == 1
        filler.kill()
        worker.join(timeout=90)
        assert not worker.is_alive()
        assert "error" not in outcome, outcome.get("error")
        created = outcome["sandbox"]
        assert created.status == "running" and created.metadata == {"case": "retried"}
        assert created.exec("echo after-retry").stdout == "after-retry\n"
        first = retries[0]
        assert (first.method, first.path, first.status_code) == ("POST", "/sandboxes", 503)
        assert first.retry_after_seconds == 5.0
        assert first.error == "no compute capacity available"
        assert 5.0 <= time.monotonic() - started < 60
    finally:
        worker.join(timeout=90)
        for sandbox in (outcome.get("sandbox"), filler):
            if sandbox is not None:
                try:
                    sandbox.kill()
                except Exception:
                    pass


@pytest.fixture(scope="module")
def two_slot_server():
    """A server whose host holds two sandboxes: a parent and one child fit, a tree of two does not."""
    from conftest import ShoalServer, _state_dir, sqlite_url, tmp_root

    server = ShoalServer("shoal-two-slots", _state_dir("-two-slots"), sqlite_url(tmp_root() / "two-slots.db"),
                         extra_args=("--max-sandboxes", "2"))
    server.start()
    yield server
    server.stop()


def test_a_fork_tree_that_does_not_fit_is_503_and_makes_no_child(two_slot_server):
    token = two_slot_server.create_token("sdk-capacity-tree", "team")
    client = two_slot_server.client(token, max_create_retry_seconds=0)
    http = two_slot_server.http(token)
    parent = client.sandboxes.create(template="base")
    made = [parent]
    try:
        # One slot is free: the first child would fit, the second not. All or
        # nothing, and a 503 (which the SDK retries) only with nothing made.
        r = http.post(f"{two_slot_server.url}/v1/sandboxes/{parent.id}/fork-tree", json={"count": 2}, timeout=60)
        assert r.status_code == 503, r.text
        assert r.headers.get("Retry-After") == "5"
        assert error_of(r) == "no compute capacity available"
        assert [s.id for s in client.sandboxes.list()] == [parent.id]
        with pytest.raises(ServerError) as refused:
            parent.fork_tree(2)
        assert "no compute capacity available" in str(refused.value)
        assert [s.id for s in client.sandboxes.list()] == [parent.id]

        # The refused trees left their slot free: a tree of one fits.
        children = parent.fork_tree(1)
        made += children
        assert len(children) == 1 and children[0].exec("echo child").stdout == "child\n"
        assert sorted(s.id for s in client.sandboxes.list()) == sorted(s.id for s in made)
    finally:
        for sandbox in reversed(made):
            try:
                sandbox.kill()
            except Exception:
                pass

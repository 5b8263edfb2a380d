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

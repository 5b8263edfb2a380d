"""Tier quotas: 100 creates fired at once on a fresh Free account give exactly 5 sandboxes."""

import threading
import time

import pytest
import requests

from pandastack import BadRequestError
from sdkhelpers import error_of

ATTEMPTS = 100
FREE_CONCURRENT = 5


def fire_creates_at_once(url: str, token: str, n: int):
    barrier = threading.Barrier(n)
    answers = [None] * n

    def create(i: int) -> None:
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {token}"
        barrier.wait()
        try:
            answers[i] = session.post(f"{url}/v1/sandboxes", json={"template": "base"}, timeout=180)
        except requests.RequestException as error:  # reported below, not swallowed
            answers[i] = error

    threads = [threading.Thread(target=create, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def test_free_tier_race_gives_exactly_five_sandboxes(shoal, make_account):
    free = make_account("free", "quota")
    http = shoal.http(free.token)
    answers = fire_creates_at_once(shoal.url, free.token, ATTEMPTS)
    created = [a.json()["id"] for a in answers if isinstance(a, requests.Response) and a.status_code == 201]
    try:
        failures = [a for a in answers if not isinstance(a, requests.Response)]
        assert failures == []
        statuses = sorted(a.status_code for a in answers)
        assert statuses.count(201) == FREE_CONCURRENT, statuses
        assert statuses.count(429) == ATTEMPTS - FREE_CONCURRENT, statuses
        for refusal in (a for a in answers if a.status_code == 429):
            assert "Retry-After" not in refusal.headers
            message = error_of(refusal).lower()
            assert "concurrent" in message and str(FREE_CONCURRENT) in message, message
        listed = http.get(f"{shoal.url}/v1/sandboxes", timeout=30).json()
        assert sorted(s["id"] for s in listed) == sorted(created)

        # The SDK raises a quota refusal at once: no Retry-After, no retry.
        retries = []
        client = shoal.client(free.token, on_create_retry=retries.append)
        started = time.monotonic()
        with pytest.raises(BadRequestError) as refused:
            client.sandboxes.create(template="base")
        assert time.monotonic() - started < 5
        assert retries == []
        assert "concurrent" in str(refused.value).lower()
    finally:
        for sandbox_id in created:
            http.delete(f"{shoal.url}/v1/sandboxes/{sandbox_id}", timeout=60)

    # Deleting frees the slots at once.
    again = shoal.client(free.token).sandboxes.create(template="base")
    again.kill()

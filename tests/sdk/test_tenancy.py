"""A token sees only its own account: everything else is a 404, never a 403."""

import dataclasses

import pytest
import requests

from pandastack import NotFoundError
from sdkhelpers import error_of


def test_another_accounts_sandbox_is_not_found(shoal, client, sandboxes, make_account):
    mine = sandboxes(metadata={"owner": "main"})
    mine.filesystem.write("/tmp/secret.txt", "mine")
    stranger_account = make_account("free", "stranger")
    stranger = shoal.client(stranger_account.token)
    # The same sandbox id, driven with the other account's client.
    theirs = dataclasses.replace(mine, _client=stranger)

    assert mine.id not in {s.id for s in stranger.sandboxes.list()}
    with pytest.raises(NotFoundError):
        stranger.sandboxes.get(mine.id)
    with pytest.raises(NotFoundError):
        theirs.exec("cat /tmp/secret.txt")
    with pytest.raises(NotFoundError):
        theirs.filesystem.read("/tmp/secret.txt")
    with pytest.raises(NotFoundError):
        theirs.filesystem.write("/tmp/secret.txt", "overwritten")
    with pytest.raises(NotFoundError):
        theirs.lifecycle()
    with pytest.raises(NotFoundError):
        theirs.set_ttl(1)
    with pytest.raises(NotFoundError):
        theirs.fork()
    with pytest.raises(NotFoundError):
        theirs.pause()
    with pytest.raises(NotFoundError):
        theirs.create_code_context()
    with pytest.raises(NotFoundError):
        theirs.kill()

    auth = {"Authorization": f"Bearer {stranger_account.token}"}
    usage = requests.get(f"{shoal.url}/v1/sandboxes/{mine.id}/usage", headers=auth, timeout=30)
    assert usage.status_code == 404
    error_of(usage)
    foreign = requests.get(f"{shoal.url}/v1/sandboxes/{mine.id}", headers=auth, timeout=30)
    missing = requests.get(f"{shoal.url}/v1/sandboxes/no-such-sandbox", headers=auth, timeout=30)
    assert foreign.status_code == missing.status_code == 404
    assert error_of(foreign).replace(mine.id, "<id>") == error_of(missing).replace("no-such-sandbox", "<id>"), \
        "a foreign sandbox must look exactly like a missing one"

    assert client.sandboxes.get(mine.id).status == "running"
    assert mine.filesystem.read("/tmp/secret.txt") == b"mine"
    assert mine.lifecycle()["ttl_seconds"] != 1

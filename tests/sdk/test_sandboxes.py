"""Create, list, get and kill, through the SDK's default client and an explicit one."""

import datetime

import pytest

from pandastack import NotFoundError, Sandbox
from sdkhelpers import parse_time


def test_create_with_ttl_and_metadata_via_environment(sdk_env, sandboxes):
    metadata = {"suite": "sdk", "case": "create"}
    sb = sandboxes.track(Sandbox.create(template="base", ttl_seconds=300, metadata=metadata))

    assert isinstance(sb.id, str) and sb.id
    assert sb.template == "base"
    assert sb.status == "running"
    assert sb.metadata == metadata
    assert sb.cpu > 0 and sb.memory_mb > 0
    assert sb.persistent is False
    assert sb.from_snapshot is None
    created = parse_time(sb.created_at)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - created).total_seconds()) < 300
    assert sb.lifecycle()["ttl_seconds"] == 300

    again = Sandbox.get(sb.id)
    assert (again.id, again.template, again.metadata) == (sb.id, "base", metadata)
    assert sb.id in {s.id for s in Sandbox.list()}
    assert sb.exec("echo ready").stdout == "ready\n"


def test_list_get_and_kill(client, sandboxes):
    first = sandboxes(metadata={"n": "1"})
    second = sandboxes(metadata={"n": "2"})

    listed = {s.id: s for s in client.sandboxes.list()}
    assert {first.id, second.id} <= set(listed)
    assert listed[second.id].metadata == {"n": "2"}
    assert client.sandboxes.get(first.id).metadata == {"n": "1"}

    first.kill()
    with pytest.raises(NotFoundError):
        client.sandboxes.get(first.id)
    assert first.id not in {s.id for s in client.sandboxes.list()}
    assert client.sandboxes.get(second.id).status == "running"
    with pytest.raises(NotFoundError):
        first.kill()


def test_context_manager_kills_on_exit(client):
    with client.sandboxes.create(template="base") as sb:
        assert sb.exec("true").exit_code == 0
    with pytest.raises(NotFoundError):
        client.sandboxes.get(sb.id)


def test_refresh_reads_the_server_state(client, sandboxes):
    sb = sandboxes(metadata={"k": "v"})
    sb.metadata = {}
    sb.status = "stale"
    sb.refresh()
    assert sb.metadata == {"k": "v"}
    assert sb.status == "running"

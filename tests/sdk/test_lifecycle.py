"""Lifecycle (TTL, persistence), pause/resume, snapshots, hibernate/wake."""

import datetime

import pytest

from pandastack import BadRequestError, NotFoundError
from sdkhelpers import parse_time


def start_detached_sleeper(sb) -> str:
    """A detached guest process, started the way the SDK's CMA worker starts its runner."""
    pid = sb.exec("setsid sleep 631 </dev/null >/dev/null 2>&1 & echo $!").stdout.strip()
    assert pid.isdigit()
    return pid


def test_set_ttl_and_set_persistent_are_reflected_in_lifecycle(client, sandboxes):
    sb = sandboxes(ttl_seconds=120)
    lifecycle = sb.lifecycle()
    assert lifecycle["ttl_seconds"] == 120
    assert lifecycle["persistent"] is False
    assert isinstance(lifecycle["idle_seconds"], int) and lifecycle["idle_seconds"] >= 0

    assert sb.set_ttl(900)["ttl_seconds"] == 900
    assert sb.lifecycle()["ttl_seconds"] == 900

    assert sb.set_persistent(True)["persistent"] is True
    lifecycle = sb.lifecycle()
    assert (lifecycle["persistent"], lifecycle["ttl_seconds"]) == (True, 900)
    assert client.sandboxes.get(sb.id).persistent is True

    sb.set_persistent(False)
    assert client.sandboxes.get(sb.id).persistent is False
    with pytest.raises(BadRequestError):
        sb.set_ttl(-1)
    assert sb.lifecycle()["ttl_seconds"] == 900


def test_persistent_create_survives_the_context_manager(client, sandboxes):
    with client.sandboxes.create(template="base", persistent=True) as sb:
        sandboxes.track(sb)
        assert sb.persistent is True
    assert client.sandboxes.get(sb.id).persistent is True
    assert sb.lifecycle()["persistent"] is True


def test_pause_then_resume_then_exec(client, sandboxes):
    sb = sandboxes()
    sb.filesystem.write("/root/before-pause.txt", "kept")
    sb.pause()
    assert client.sandboxes.get(sb.id).status == "paused"
    with pytest.raises(BadRequestError):
        sb.exec("true")
    sb.resume()
    assert client.sandboxes.get(sb.id).status == "running"
    assert sb.exec("cat /root/before-pause.txt").stdout == "kept"


def test_snapshot_then_create_from_snapshot(client, sandboxes, shoal, make_account):
    source = sandboxes(metadata={"case": "snapshot"})
    source.filesystem.write("/root/snap.txt", "on-disk")  # /root is on the disk
    source.exec("printf 'in-memory' > /dev/shm/snap")  # tmpfs: guest memory

    snapshot_id = source.snapshot()
    assert snapshot_id and snapshot_id != "None"
    source.filesystem.write("/root/snap.txt", "changed-after")

    # No template argument: the SDK sends its default "code-interpreter" along
    # with from_snapshot, and the server must restore the snapshot's template.
    restored = sandboxes.track(client.sandboxes.create(from_snapshot=snapshot_id))
    assert restored.id != source.id
    assert restored.template == "base"
    assert restored.from_snapshot == snapshot_id
    assert restored.filesystem.read("/root/snap.txt") == b"on-disk"
    assert restored.exec("cat /dev/shm/snap").stdout == "in-memory"
    assert source.filesystem.read("/root/snap.txt") == b"changed-after"

    assert snapshot_id in {s["id"] for s in client.snapshots.list()}
    mine = client.snapshots.list(sandbox_id=source.id)
    assert [s["id"] for s in mine] == [snapshot_id]
    assert mine[0]["sandbox_id"] == source.id

    stranger = shoal.client(make_account("free", "snapshot-stranger").token)
    assert snapshot_id not in {s["id"] for s in stranger.snapshots.list()}
    with pytest.raises(NotFoundError):
        stranger.sandboxes.create(template="base", from_snapshot=snapshot_id)


def test_hibernate_then_wake_keeps_processes_memory_and_disk(client, sandboxes):
    sb = sandboxes()
    sb.filesystem.write("/root/hib.txt", "disk")
    sb.exec("printf 'memory' > /dev/shm/hib")
    pid = start_detached_sleeper(sb)

    sb.hibernate()
    assert client.sandboxes.get(sb.id).status == "hibernated"
    sb.wake()
    assert client.sandboxes.get(sb.id).status == "running"
    sb.wake()  # idempotent when running

    assert sb.exec("cat /root/hib.txt /dev/shm/hib").stdout == "diskmemory"
    assert sb.exec(f"kill -0 {pid}").exit_code == 0


def test_exec_wakes_a_hibernated_sandbox(client, sandboxes):
    sb = sandboxes()
    sb.exec("printf 'still here' > /dev/shm/auto")
    sb.hibernate()
    assert client.sandboxes.get(sb.id).status == "hibernated"
    assert sb.exec("cat /dev/shm/auto").stdout == "still here"
    assert client.sandboxes.get(sb.id).status == "running"


DEFAULT_TTL_SECONDS = 300


def test_a_sandbox_created_without_a_ttl_gets_the_300_s_default(client, sandboxes, shoal, http):
    sb = sandboxes()  # the SDK sends no ttl_seconds
    lifecycle = sb.lifecycle()
    assert lifecycle["ttl_seconds"] == DEFAULT_TTL_SECONDS
    assert lifecycle["persistent"] is False
    left = (parse_time(lifecycle["expires_at"]) - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    assert DEFAULT_TTL_SECONDS - 30 < left <= DEFAULT_TTL_SECONDS + 1, lifecycle
    assert http.get(f"{shoal.url}/v1/sandboxes/{sb.id}", timeout=30).json()["ttl_seconds"] == DEFAULT_TTL_SECONDS

    # An explicit null is the default too.
    r = http.post(f"{shoal.url}/v1/sandboxes", json={"template": "base", "ttl_seconds": None}, timeout=60)
    assert r.status_code == 201, r.text
    explicit = sandboxes.track(client.sandboxes.get(r.json()["id"]))
    assert r.json()["ttl_seconds"] == DEFAULT_TTL_SECONDS
    assert explicit.lifecycle()["ttl_seconds"] == DEFAULT_TTL_SECONDS


def test_patching_ttl_seconds_to_null_restores_the_default(sandboxes):
    sb = sandboxes(ttl_seconds=60)
    assert sb.lifecycle()["ttl_seconds"] == 60
    assert sb.set_ttl(None)["ttl_seconds"] == DEFAULT_TTL_SECONDS
    assert sb.lifecycle()["ttl_seconds"] == DEFAULT_TTL_SECONDS

"""fork, fork_tree and promote: children get the parent's memory and disk, and nothing else."""

import pytest

from conftest import kill_quietly
from pandastack import BadRequestError, NotFoundError
from sdkhelpers import error_of


def prepare_parent(sandboxes, tag):
    parent = sandboxes(metadata={"suite": "sdk-fork", "case": tag})
    parent.filesystem.write("/root/from-parent.txt", f"disk-{tag}")  # /root is on the disk
    parent.exec(f"printf 'mem-{tag}' > /dev/shm/from-parent")  # tmpfs: guest memory
    return parent


def test_fork_child_has_the_parents_memory_and_disk(sandboxes):
    parent = prepare_parent(sandboxes, "single")
    child = sandboxes.track(parent.fork(metadata={"role": "child"}))

    assert child.id != parent.id
    assert child.status == "running"
    assert child.metadata["role"] == "child"
    assert child.metadata["fork_parent_id"] == parent.id
    assert child.filesystem.read("/root/from-parent.txt") == b"disk-single"
    assert child.exec("cat /dev/shm/from-parent").stdout == "mem-single"

    child.filesystem.write("/root/from-child.txt", "child")
    assert not parent.filesystem.exists("/root/from-child.txt")
    assert parent.exec("echo parent-alive").stdout == "parent-alive\n"


def test_fork_tree_children_share_the_fork_point_and_nothing_after_it(sandboxes):
    parent = prepare_parent(sandboxes, "tree")
    children = sandboxes.track(*parent.fork_tree(2, metadata={"branch": "yes"}))

    assert len(children) == 2
    first, second = children
    assert len({parent.id, first.id, second.id}) == 3
    tree_ids = {child.metadata.get("fork_tree_id") for child in children}
    assert len(tree_ids) == 1 and None not in tree_ids and "" not in tree_ids
    for child in children:
        assert child.metadata["fork_parent_id"] == parent.id
        assert child.metadata["branch"] == "yes"
        assert child.filesystem.read("/root/from-parent.txt") == b"disk-tree"
        assert child.exec("cat /dev/shm/from-parent").stdout == "mem-tree"

    first.filesystem.write("/root/only-first.txt", "1")
    first.exec("echo 1 > /dev/shm/only-first")
    parent.filesystem.write("/root/parent-after-fork.txt", "p")
    assert not parent.filesystem.exists("/root/only-first.txt")
    assert not second.filesystem.exists("/root/only-first.txt")
    assert second.exec("test -e /dev/shm/only-first").exit_code == 1
    assert not first.filesystem.exists("/root/parent-after-fork.txt")
    assert not second.filesystem.exists("/root/parent-after-fork.txt")


def test_promote_with_cleanup_siblings_deletes_the_siblings(client, sandboxes):
    parent = prepare_parent(sandboxes, "promote")
    winner, loser = sandboxes.track(*parent.fork_tree(2))

    answer = winner.promote(cleanup_siblings=True)

    assert answer["winner"] == winner.id
    assert answer["tree_id"] == winner.metadata["fork_tree_id"]
    assert answer["deleted"] == [loser.id]
    assert dict(answer["failures"] or {}) == {}
    with pytest.raises(NotFoundError):
        client.sandboxes.get(loser.id)
    assert winner.exec("cat /root/from-parent.txt").stdout == "disk-promote"
    assert client.sandboxes.get(parent.id).status == "running"

    again = winner.promote(cleanup_siblings=True, tree_id=answer["tree_id"])
    assert again["deleted"] == []


def live_ids(client):
    return [s.id for s in client.sandboxes.list()]


def test_a_fork_tree_past_the_quota_is_refused_whole(shoal, make_account):
    """The Free tier holds five sandboxes: a parent and a tree of five would be
    six. The first four children are admitted before the fifth is refused;
    all or nothing: none of them may remain, nor hold a slot."""
    free = make_account("free", "fork-tree-quota")
    client = shoal.client(free.token, max_create_retry_seconds=0)
    http = shoal.http(free.token)
    parent = client.sandboxes.create(template="base")
    made = [parent]
    try:
        r = http.post(f"{shoal.url}/v1/sandboxes/{parent.id}/fork-tree", json={"count": 5}, timeout=60)
        assert r.status_code == 429, r.text
        assert "Retry-After" not in r.headers
        assert "concurrent" in error_of(r)
        assert live_ids(client) == [parent.id]
        with pytest.raises(BadRequestError):
            parent.fork_tree(5)
        assert live_ids(client) == [parent.id]

        # The refused trees' children hold no slot: four still fit.
        children = parent.fork_tree(4)
        made += children
        assert len(children) == 4
        assert sorted(live_ids(client)) == sorted(s.id for s in made)
        assert children[0].exec("echo child").stdout == "child\n"
    finally:
        for sandbox in reversed(made):
            kill_quietly(sandbox)


def test_a_refused_fork_tree_charges_nothing_to_the_hourly_quota(shoal, make_account):
    """Refused creates do not count towards either limit (4.1), and a fork-tree
    is all or nothing (1.8): the children admitted before the refusal must not
    be charged to the Free tier's 60 creates an hour either."""
    free = make_account("free", "fork-tree-hourly")
    client = shoal.client(free.token, max_create_retry_seconds=0)
    http = shoal.http(free.token)
    parent = client.sandboxes.create(template="base")
    made = [parent]
    try:
        # Each refusal admits four children (the parent is the fifth sandbox)
        # before the sixth is refused: fifteen of them are sixty children.
        refusals = []
        for _ in range(15):
            r = http.post(f"{shoal.url}/v1/sandboxes/{parent.id}/fork-tree", json={"count": 16}, timeout=60)
            assert r.status_code == 429, r.text
            refusals.append(error_of(r))
        assert live_ids(client) == [parent.id]
        assert all("concurrent" in message for message in refusals), \
            f"the children admitted before each refusal were charged as creates: {sorted(set(refusals))}"
        child = parent.fork()
        made.append(child)
        assert child.exec("echo child").stdout == "child\n"
    finally:
        for sandbox in reversed(made):
            kill_quietly(sandbox)

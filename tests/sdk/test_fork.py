"""fork, fork_tree and promote: children get the parent's memory and disk, and nothing else."""

import pytest

from pandastack import NotFoundError


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

"""The file API: read, write, listdir, stat, exists, and the raw delete route."""

import hashlib
import time

import pytest
import requests

from pandastack import NotFoundError
from sdkhelpers import error_of


@pytest.fixture(scope="module")
def sb(module_sandboxes):
    return module_sandboxes(metadata={"suite": "sdk-files"})


def test_binary_round_trip_is_byte_exact(sb):
    data = bytes(range(256)) * 257 + b"\r\n\x00\xff"
    sb.filesystem.write("/root/blob.bin", data)
    assert sb.filesystem.read("/root/blob.bin") == data
    digest = sb.exec("sha256sum /root/blob.bin").stdout.split()[0]
    assert digest == hashlib.sha256(data).hexdigest()


def test_write_creates_parents_and_exec_sees_the_file(sb):
    answer = sb.filesystem.write("/root/new/deeper/hello.txt", "héllo")
    assert answer["path"] == "/root/new/deeper/hello.txt"
    assert answer["bytes"] == len("héllo".encode())
    assert sb.exec("cat /root/new/deeper/hello.txt").stdout == "héllo"
    sb.filesystem.write("/root/new/deeper/hello.txt", "short")
    assert sb.filesystem.read("/root/new/deeper/hello.txt") == b"short"


def test_a_file_written_by_exec_is_read_back(sb):
    sb.exec("mkdir -p /tmp/fromexec && printf 'abc' > '/tmp/fromexec/a b.txt'")
    assert sb.filesystem.read("/tmp/fromexec/a b.txt") == b"abc"


def test_listdir_and_stat(sb):
    sb.exec("rm -rf /tmp/tree && mkdir -p /tmp/tree/sub && printf '12345' > /tmp/tree/five.txt")
    entries = {e.name: e for e in sb.filesystem.listdir("/tmp/tree")}
    assert set(entries) == {"sub", "five.txt"}
    assert entries["sub"].is_dir and not entries["five.txt"].is_dir
    assert entries["five.txt"].size == 5
    assert entries["five.txt"].path == "/tmp/tree/five.txt"
    assert abs(entries["five.txt"].mtime - time.time()) < 300

    info = sb.filesystem.stat("/tmp/tree/five.txt")
    assert (info.name, info.path, info.is_dir, info.size) == ("five.txt", "/tmp/tree/five.txt", False, 5)
    assert sb.filesystem.stat("/tmp/tree/sub").is_dir
    assert [e.name for e in sb.filesystem.listdir("/tmp/tree/sub")] == []
    walked = {path: sorted(f.name for f in files) for path, _, files in sb.filesystem.walk("/tmp/tree")}
    assert walked == {"/tmp/tree": ["five.txt"], "/tmp/tree/sub": []}


def test_exists_and_missing_paths(sb):
    sb.filesystem.write("/tmp/present.txt", b"x")
    assert sb.filesystem.exists("/tmp/present.txt")
    assert sb.filesystem.exists("/tmp")
    assert not sb.filesystem.exists("/tmp/absent.txt")
    with pytest.raises(NotFoundError):
        sb.filesystem.stat("/tmp/absent.txt")
    with pytest.raises(NotFoundError):
        sb.filesystem.read("/tmp/absent.txt")
    with pytest.raises(NotFoundError):
        sb.filesystem.listdir("/tmp/absent-dir")


def test_delete_route_removes_a_tree(shoal, account, sb):
    sb.exec("mkdir -p /tmp/doomed/inner && touch /tmp/doomed/inner/f")
    url = f"{shoal.url}/v1/sandboxes/{sb.id}/fs"
    auth = {"Authorization": f"Bearer {account.token}"}
    r = requests.delete(url, params={"path": "/tmp/doomed"}, headers=auth, timeout=30)
    assert r.status_code == 204
    assert not sb.filesystem.exists("/tmp/doomed")
    r = requests.delete(url, params={"path": "/tmp/doomed"}, headers=auth, timeout=30)
    assert r.status_code == 404
    error_of(r)


def test_relative_path_is_400(shoal, account, sb):
    r = requests.get(f"{shoal.url}/v1/sandboxes/{sb.id}/fs/stat", params={"path": "tmp"},
                     headers={"Authorization": f"Bearer {account.token}"}, timeout=30)
    assert r.status_code == 400
    error_of(r)


def test_uploads_past_the_old_32_mib_cap_stream_through(shoal, account, sb):
    size = 32 * 1024 * 1024 + 1
    r = requests.put(f"{shoal.url}/v1/sandboxes/{sb.id}/fs", params={"path": "/tmp/big.bin"},
                     data=b"\1" * size, timeout=300,
                     headers={"Authorization": f"Bearer {account.token}",
                              "Content-Type": "application/octet-stream"})
    assert r.status_code in (200, 201), r.text
    assert sb.filesystem.stat("/tmp/big.bin").size == size
    r = requests.delete(f"{shoal.url}/v1/sandboxes/{sb.id}/fs", params={"path": "/tmp/big.bin"},
                        headers={"Authorization": f"Bearer {account.token}"}, timeout=30)
    assert r.status_code == 204


def test_an_upload_declared_past_1_gib_is_413_before_its_body_and_writes_nothing(shoal, account, sb):
    import http.client
    import urllib.parse
    url = urllib.parse.urlsplit(shoal.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.putrequest("PUT", f"/v1/sandboxes/{sb.id}/fs?path=/tmp/huge.bin")
    conn.putheader("Authorization", f"Bearer {account.token}")
    conn.putheader("Content-Type", "application/octet-stream")
    conn.putheader("Content-Length", str(1024 * 1024 * 1024 + 1))
    conn.endheaders()
    conn.send(b"\0" * 4096)
    r = conn.getresponse()
    assert r.status == 413
    assert "exceeds" in r.read().decode()
    conn.close()
    assert not sb.filesystem.exists("/tmp/huge.bin")

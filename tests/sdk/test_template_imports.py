"""Templates from a root filesystem tarball (`templates.build(...,
rootfs_tar=...)`), from an OCI image archive and from an image in a real
registry the host trusts (`templates.register(name, image_ref)`), through
the SDK's own calls, on real VMs (issue 21).

Neither root filesystem is Debian: both are a busybox made in the test, so
the guest agent that runs them must be the static one. A sandbox of each
runs `exec`; the OCI image's whiteouts, `Env` and `WorkingDir` hold. Hostile
inputs (an entry that leaves the root, a disk over the tier's limit, an
archive outside the host's archive directory, a registry the host does not
trust, a tag the registry lacks) fail
with what was wrong and leave no template or snapshot."""

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile

import pytest

from pandastack import PandastackError

BUSYBOX = shutil.which("busybox") or "/bin/busybox"


def _add(tar, name, data=b"", mode=0o644, kind=tarfile.REGTYPE, link=""):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def _busybox_rootfs(tar):
    """A root filesystem of one static busybox and its applets' links."""
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for d in ("bin", "etc", "root", "tmp"):
        _add(tar, d, kind=tarfile.DIRTYPE, mode=0o755)
    with open(BUSYBOX, "rb") as f:
        _add(tar, "bin/busybox", f.read(), mode=0o755)
    for applet in applets:
        if applet != "busybox":
            _add(tar, f"bin/{applet}", kind=tarfile.SYMTYPE, link="busybox")
    _add(tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    _add(tar, "etc/group", b"root:x:0:\n")
    _add(tar, "etc/motd", b"lower layer\n")


def _tar_bytes(fill, gz=False):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        fill(tar)
    data = raw.getvalue()
    return gzip.compress(data) if gz else data


def _oci_image():
    """An OCI image: busybox below, a layer above that adds /work/hello.txt
    and whites out /etc/motd; Env and WorkingDir set. Returns its blobs
    ({sha256 hex: bytes}, the manifest among them), its manifest's
    descriptor and its index (one linux/amd64 manifest)."""
    blobs = {}

    def blob(data):
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": f"sha256:{digest}", "size": len(data)}

    lower = blob(_tar_bytes(_busybox_rootfs, gz=True))

    def upper_fill(tar):
        _add(tar, "work", kind=tarfile.DIRTYPE, mode=0o755)
        _add(tar, "work/hello.txt", b"from the upper layer\n")
        _add(tar, "etc/.wh.motd")

    upper = blob(_tar_bytes(upper_fill))
    config = blob(json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin", "GREETING=from-the-image-config"], "WorkingDir": "/work"},
        "rootfs": {"type": "layers", "diff_ids": []},
    }).encode())
    manifest = blob(json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": dict(config, mediaType="application/vnd.oci.image.config.v1+json"),
        "layers": [dict(lower, mediaType="application/vnd.oci.image.layer.v1.tar+gzip"),
                   dict(upper, mediaType="application/vnd.oci.image.layer.v1.tar")],
    }).encode())
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [dict(
        manifest, mediaType="application/vnd.oci.image.manifest.v1+json",
        platform={"architecture": "amd64", "os": "linux"})]}
    return blobs, manifest, index


def _oci_archive(path):
    """The image of `_oci_image` as an OCI image layout in a tar."""
    blobs, _, index = _oci_image()
    with tarfile.open(path, "w") as tar:
        _add(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _add(tar, "index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            _add(tar, f"blobs/sha256/{digest}", data)


def _assert_runs_the_oci_image(client, template):
    """A sandbox of `template` (the image of `_oci_image`) runs exec with the
    image's WorkingDir and Env, its upper layer's file and its whiteout."""
    sandbox = client.sandboxes.create(template=template)
    try:
        out = sandbox.exec('pwd; echo "$GREETING"; cat hello.txt; test -e /etc/motd && echo motd || echo whited-out')
        assert out.stdout.splitlines() == [
            "/work", "from-the-image-config", "from the upper layer", "whited-out",
        ], out.stdout
    finally:
        sandbox.kill()


def _no_snapshots(shoal, token):
    body = shoal.http(token).get(f"{shoal.url}/v1/snapshots", timeout=30).json()
    items = next((v for v in body.values() if isinstance(v, list)), []) if isinstance(body, dict) else body
    return items == []


def test_a_busybox_rootfs_tarball_becomes_a_template_that_runs_exec(shoal, make_account, tmp_path):
    owner = make_account("team", "imports-rootfs")
    client = shoal.client(owner.token)
    rootfs = tmp_path / "busybox-rootfs.tar"
    rootfs.write_bytes(_tar_bytes(_busybox_rootfs))
    build = client.templates.build("tiny", rootfs_tar=str(rootfs), size_mb=256, timeout_seconds=600)
    log = list(client.templates.build_logs(build.id, follow=False))
    assert build.status == "done", (build, log)
    assert any("entries" in line for line in log), log
    assert client.templates.get("tiny").name == "tiny"

    sandbox = client.sandboxes.create(template="tiny")
    try:
        out = sandbox.exec("busybox | head -n 1; test -e /etc/debian_version && echo debian || echo not-debian; cat /etc/motd")
        assert out.exit_code == 0, out
        lines = out.stdout.splitlines()
        assert lines[0].startswith("BusyBox"), out.stdout
        assert lines[1:] == ["not-debian", "lower layer"], out.stdout
        # Files go in and out as on any template.
        sandbox.filesystem.write("/tmp/note.txt", "written through the agent")
        assert sandbox.exec("cat /tmp/note.txt").stdout == "written through the agent"
    finally:
        sandbox.kill()

    # The same tarball again: a cache hit, no VM.
    again = client.templates.build("tiny", rootfs_tar=str(rootfs), size_mb=256, timeout_seconds=120)
    assert again.status == "done"
    assert any("cache hit" in l for l in client.templates.build_logs(again.id, follow=False))


def test_an_oci_image_archive_becomes_a_template_with_its_layers_and_config(shoal, make_account):
    owner = make_account("team", "imports-oci")
    client = shoal.client(owner.token)
    archives = shoal.state_dir / "image-archives"
    archives.mkdir(parents=True, exist_ok=True)
    _oci_archive(archives / "busybox-oci.tar")

    build = client.templates.register("tiny-oci", "oci-archive:busybox-oci.tar", size_mb=256)
    build = client.templates.wait_for_build(build.id, poll_interval=0.5, timeout_seconds=600)
    log = list(client.templates.build_logs(build.id, follow=False))
    assert build.status == "done", (build, log)
    assert any("2 layer(s)" in line for line in log), log

    _assert_runs_the_oci_image(client, "tiny-oci")


def test_an_image_in_a_trusted_registry_is_pulled_and_becomes_a_template(shoal, registry, make_account):
    """The image of the archive test, pushed to a real registry (Debian's
    docker-registry) under an index tag, and named by reference."""
    owner = make_account("team", "imports-registry")
    client = shoal.client(owner.token)
    blobs, manifest, index = _oci_image()
    manifests = {d: b for d, b in blobs.items() if f"sha256:{d}" == manifest["digest"]}
    layers = {d: b for d, b in blobs.items() if d not in manifests}
    registry.push("lab/tiny", manifest["digest"], layers, manifests[manifest["digest"][7:]],
                  "application/vnd.oci.image.manifest.v1+json")
    registry.push("lab/tiny", "v1", {}, json.dumps(index).encode(),
                  "application/vnd.oci.image.index.v1+json")
    reference = f"{registry.address}/lab/tiny:v1"

    build = client.templates.register("tiny-pulled", reference, size_mb=256)
    build = client.templates.wait_for_build(build.id, poll_interval=0.5, timeout_seconds=600)
    log = list(client.templates.build_logs(build.id, follow=False))
    assert build.status == "done", (build, log)
    assert any(manifest["digest"] in line for line in log), log
    assert sum("pulling layer" in line for line in log) == 2, log

    _assert_runs_the_oci_image(client, "tiny-pulled")

    # The tag still names the same manifest: a cache hit, nothing pulled.
    again = client.templates.register("tiny-pulled", reference, size_mb=256)
    again = client.templates.wait_for_build(again.id, poll_interval=0.5, timeout_seconds=120)
    again_log = list(client.templates.build_logs(again.id, follow=False))
    assert again.status == "done" and any("cache hit" in l for l in again_log), again_log
    assert not any("pulling" in l for l in again_log), again_log

    # A tag the registry lacks, and a registry this host was not told to trust.
    for ref, why in [
        (f"{registry.address}/lab/tiny:missing", "manifest unknown"),
        (f"{registry.address}/lab/absent:v1", "lab/absent"),
        ("127.0.0.2:5000/lab/tiny:v1", "does not pull from"),
    ]:
        with pytest.raises(PandastackError) as refused:
            client.templates.register("nope", ref)
        assert why in str(refused.value), (ref, refused.value)
    assert sorted(t.name for t in client.templates.list() if not t.is_global) == ["tiny-pulled"]


def test_hostile_imports_fail_with_the_reason_and_leave_nothing(shoal, make_account, tmp_path):
    owner = make_account("free", "imports-hostile")
    client = shoal.client(owner.token)

    def escaping(tar):
        _busybox_rootfs(tar)
        _add(tar, "../../../../tmp/shoal-escaped", b"should never be written")

    evil = tmp_path / "evil.tar"
    evil.write_bytes(_tar_bytes(escaping))
    build = client.templates.build("evil", rootfs_tar=str(evil), size_mb=256, timeout_seconds=600)
    assert build.status == "failed" and "leaves the root" in (build.error or ""), build

    # A disk over the free tier's largest (4 GiB) is refused before upload ends.
    small = tmp_path / "small.tar"
    small.write_bytes(_tar_bytes(_busybox_rootfs))
    with pytest.raises(PandastackError) as too_big:
        client.templates.build("huge", rootfs_tar=str(small), size_mb=8192)
    assert "size_mb" in str(too_big.value), too_big.value

    for reference, why in [
        ("/etc/passwd", "archive directory"),
        ("oci-archive:../../../etc/passwd", "archive directory"),
        ("docker.io/library/busybox:latest", "registry"),
    ]:
        with pytest.raises(PandastackError) as refused:
            client.templates.register("nope", reference)
        assert why in str(refused.value), (reference, refused.value)

    assert [t.name for t in client.templates.list() if not t.is_global] == []
    assert _no_snapshots(shoal, owner.token)

"""Template builds from a Dockerfile through the SDK's own calls
(`templates.build_from_dockerfile`, `build_logs`, `wait_for_build`,
`get_build`, `builds`), on real VMs (issue 21).

A build with a context file, a `pip install` from the package index, an
`ENV`, a `WORKDIR` and a `USER` makes a template whose sandboxes see all of
them; its log streams and ends; it is another account's 404; an unchanged
rebuild is a cache hit. A `CMD` with a `HEALTHCHECK` is running in every
fresh sandbox with no exec. Bad Dockerfiles (an unknown instruction, a
missing COPY source, an oversize context, a failing RUN) fail with the line
named and leave no template, sandbox or snapshot."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from pandastack import NotFoundError, PandastackError, TemplateBuildError

# The pip wheel and the host's CA bundle come in the context: Debian's
# python3 has no pip, and the bundle trusts whatever TLS proxy this host's
# egress goes through (plain Debian CAs where there is none). `tomli` itself
# comes from the package index, fetched inside the builder VM.
ANALYSIS = """\
# A researcher's environment: one package from PyPI, their data, a user.
FROM code-interpreter
ARG PKG=tomli==2.0.1
ENV GREETING="hello from the image" DATA_DIR=/opt/data
COPY data.txt $DATA_DIR/
COPY scripts/ /opt/scripts/
COPY tools/ /tmp/tools/
WORKDIR /opt/data
RUN PIP_CERT=/tmp/tools/ca.crt python3 /tmp/tools/pip.whl/pip install --no-cache-dir \\
    --disable-pip-version-check --break-system-packages --root-user-action=ignore "$PKG" \\
 && rm -r /tmp/tools
RUN useradd --create-home researcher && chown researcher /opt/data
USER researcher
"""


def _tools(into):
    """pip's wheel and the host's CA bundle, for the context."""
    into.mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "pip==24.0", "-d", str(into)],
        check=True,
    )
    (into / "pip-24.0-py3-none-any.whl").rename(into / "pip.whl")
    bundle = os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    shutil.copyfile(bundle, into / "ca.crt")


def _leftovers(shoal, token):
    http = shoal.http(token)
    sandboxes = http.get(f"{shoal.url}/v1/sandboxes", timeout=30).json()
    snapshots = http.get(f"{shoal.url}/v1/snapshots", timeout=30).json()

    def items(body):
        if isinstance(body, dict):
            return next((v for v in body.values() if isinstance(v, list)), [])
        return body

    live = [s for s in items(sandboxes) if s.get("status") not in ("deleted", "failed")]
    return live, items(snapshots)


def test_a_dockerfile_build_makes_a_template_with_its_packages_files_and_env(
    shoal, make_account, tmp_path
):
    owner = make_account("team", "builds")
    client = shoal.client(owner.token)
    context = tmp_path / "context"
    (context / "scripts").mkdir(parents=True)
    (context / "data.txt").write_text("measurements 1 2 3\n")
    (context / "scripts" / "analyse.py").write_text("print('analysed')\n")
    _tools(context / "tools")

    build = client.templates.build_from_dockerfile("analysis", ANALYSIS, context_dir=str(context))
    assert build.status in ("queued", "building"), build
    lines = list(client.templates.build_logs(build.id, follow=True))
    text = "\n".join(lines)
    assert any(l.startswith("Step 1/") for l in lines), text
    assert "Successfully installed tomli-2.0.1" in text, text
    assert lines[-1] == "template analysis is ready", text
    final = client.templates.get_build(build.id)
    assert final.status == "done" and final.error is None, final
    assert final.started_at and final.ended_at
    assert build.id in {b.id for b in client.templates.builds()}
    # The log again, whole, once ended; and without follow.
    assert list(client.templates.build_logs(build.id, follow=False)) == lines

    template = client.templates.get("analysis")
    assert (template.name, template.is_global, template.base) == ("analysis", False, "code-interpreter")

    sandbox = client.sandboxes.create(template="analysis")
    try:
        version = "import tomli, importlib.metadata as m; print(m.version('tomli'))"
        assert sandbox.exec(f'python3 -c "{version}"').stdout.strip() == "2.0.1"
        assert sandbox.exec("cat data.txt").stdout == "measurements 1 2 3\n"
        assert sandbox.exec("python3 /opt/scripts/analyse.py").stdout == "analysed\n"
        assert sandbox.exec('echo "$GREETING in $DATA_DIR"').stdout == "hello from the image in /opt/data\n"
        assert sandbox.exec("pwd; whoami; echo $HOME").stdout == "/opt/data\nresearcher\n/home/researcher\n"
        # A request's own environment wins over the image's.
        r = shoal.http(owner.token).post(
            f"{shoal.url}/v1/sandboxes/{sandbox.id}/exec",
            json={"cmd": 'echo "$GREETING"', "env": {"GREETING": "mine"}},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["stdout"] == "mine\n", r.text
        # ARG values were the build's, not the image's.
        assert sandbox.exec('echo "[$PKG]"').stdout == "[]\n"
    finally:
        sandbox.kill()

    stranger = shoal.client(make_account("team", "builds-stranger").token)
    with pytest.raises(NotFoundError):
        stranger.templates.get_build(build.id)
    with pytest.raises(NotFoundError):
        list(stranger.templates.build_logs(build.id, follow=True))
    with pytest.raises(NotFoundError):
        stranger.templates.get("analysis")
    assert build.id not in {b.id for b in stranger.templates.builds()}

    # Unchanged: a cache hit, without a VM.
    started = time.monotonic()
    again = client.templates.build_from_dockerfile("analysis", ANALYSIS, context_dir=str(context))
    again = client.templates.wait_for_build(again.id, poll_interval=0.2, timeout_seconds=60)
    assert time.monotonic() - started < 5, "a cache hit took over 5 s"
    again_log = list(client.templates.build_logs(again.id, follow=True))
    assert any("cache hit" in l for l in again_log), again_log
    assert client.templates.get("analysis").meta["snapshot_id"] == final_snapshot(shoal, owner, build.id)


def final_snapshot(shoal, owner, build_id):
    return shoal.http(owner.token).get(f"{shoal.url}/v1/templates/builds/{build_id}", timeout=30).json()["snapshot_id"]


def test_a_dockerfile_cmd_runs_in_every_fresh_sandbox(shoal, make_account):
    owner = make_account("team", "builds-cmd")
    client = shoal.client(owner.token)
    # code-interpreter: base's python3-minimal has no http.server or urllib.
    dockerfile = """\
FROM code-interpreter
WORKDIR /srv/site
RUN echo served-by-the-template > index.html
HEALTHCHECK CMD python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/', timeout=2)"
CMD ["python3", "-m", "http.server", "8000"]
"""
    build = client.templates.build_from_dockerfile("site", dockerfile)
    build = client.templates.wait_for_build(build.id, poll_interval=0.5, timeout_seconds=600)
    assert build.status == "done"
    http = shoal.http(owner.token)

    def create_ms(template):
        started = time.monotonic()
        sandbox = client.sandboxes.create(template=template)
        return sandbox, (time.monotonic() - started) * 1000

    reference, reference_ms = create_ms("code-interpreter")
    reference.kill()
    sandbox, site_ms = create_ms("site")
    try:
        # No exec: the server the bake started answers through the proxy.
        r = http.get(f"{shoal.url}/v1/sandboxes/{sandbox.id}/proxy/8000/index.html", timeout=30)
        assert r.status_code == 200 and r.text == "served-by-the-template\n", (r.status_code, r.text)
        assert site_ms < max(3 * reference_ms, 1000), (site_ms, reference_ms)
    finally:
        sandbox.kill()


def test_bad_dockerfiles_fail_naming_the_line_and_leave_nothing(shoal, make_account, tmp_path):
    owner = make_account("team", "builds-bad")
    client = shoal.client(owner.token)

    with pytest.raises(PandastackError) as unknown:
        client.templates.build_from_dockerfile("bad", "FROM base\nRUN true\nSHOUT loudly\n")
    assert "line 3" in str(unknown.value) and "SHOUT" in str(unknown.value)

    # A size above the base's is refused, not ignored.
    with pytest.raises(PandastackError) as sized:
        client.templates.build_from_dockerfile("bad", "FROM base\nRUN true\n", cpu=16, memory_mb=1024)
    assert "at most its base's size" in str(sized.value) and "8 vCPUs and 4096 MiB" in str(sized.value), sized.value

    context = tmp_path / "ctx"
    context.mkdir()
    (context / "present.txt").write_text("here")
    with pytest.raises(PandastackError) as missing:
        client.templates.build_from_dockerfile(
            "bad", "FROM base\nCOPY present.txt /a/\nCOPY absent.txt /a/\n", context_dir=str(context)
        )
    assert "line 3" in str(missing.value) and "absent.txt" in str(missing.value)

    big = tmp_path / "big"
    big.mkdir()
    (big / "blob.bin").write_bytes(b"\0" * (51 << 20))
    with pytest.raises(PandastackError) as oversize:
        client.templates.build_from_dockerfile("bad", "FROM base\nCOPY blob.bin /\n", context_dir=str(big))
    assert "context" in str(oversize.value) and "50 MiB" in str(oversize.value)

    failing = client.templates.build_from_dockerfile(
        "bad", "FROM base\nRUN echo before\nRUN echo about to fail && exit 3\nRUN echo never\n"
    )
    with pytest.raises(TemplateBuildError) as failed:
        client.templates.wait_for_build(failing.id, poll_interval=0.5, timeout_seconds=600)
    assert "Dockerfile line 3" in str(failed.value) and "status 3" in str(failed.value)
    lines = list(client.templates.build_logs(failing.id, follow=True))
    assert "about to fail" in lines and "never" not in lines, lines
    with pytest.raises(NotFoundError):
        client.templates.get("bad")
    live, snapshots = _leftovers(shoal, owner.token)
    assert live == [] and snapshots == [], (live, snapshots)


def test_the_cli_builds_lists_and_removes_a_template(shoal, make_account, tmp_path):
    """`shoal template build -f`, `template list`, `template rm` against
    the same server, as a user with SHOAL_API and SHOAL_API_KEY set."""
    from conftest import shoal_bin

    owner = make_account("team", "builds-cli")
    project = tmp_path / "project"
    (project / "bin").mkdir(parents=True)
    (project / "bin" / "hello").write_text("#!/bin/sh\necho hello from $WHO\n")
    (project / "secret.key").write_text("not for the image")
    (project / ".dockerignore").write_text("*.key\n")
    (project / "Dockerfile").write_text(
        "FROM base\nENV WHO=the-cli\nCOPY bin/hello /usr/local/bin/\n"
        "RUN chmod +x /usr/local/bin/hello && echo built-by-the-cli\n"
    )
    env = dict(os.environ, SHOAL_API=shoal.url, SHOAL_API_KEY=owner.token,
               SHOAL_SLURM_CONFIG=str(tmp_path / "none.json"))

    def shoal_cli(*args, check=True):
        done = subprocess.run([shoal_bin(), *args], env=env, capture_output=True, text=True, timeout=900)
        assert not check or done.returncode == 0, (args, done.returncode, done.stdout, done.stderr)
        return done

    built = shoal_cli("template", "build", "-f", str(project / "Dockerfile"), "tool")
    assert built.stdout.startswith("tool: ready (build bld-"), built.stdout
    # The log streamed to the terminal while the build ran.
    assert "built-by-the-cli" in built.stderr + built.stdout, built
    listed = shoal_cli("template", "list").stdout.splitlines()
    assert listed[0].split()[:3] == ["NAME", "CPUS", "MEM_MB"], listed
    row = next(line.split() for line in listed if line.startswith("tool "))
    assert row[3:5] == ["account", "base"], row

    client = shoal.client(owner.token)
    sandbox = client.sandboxes.create(template="tool")
    try:
        result = sandbox.exec("hello; test -e /secret.key || echo no-key")
        assert result.stdout == "hello from the-cli\nno-key\n", result.stdout
    finally:
        sandbox.kill()

    again = shoal_cli("template", "build", "-f", str(project / "Dockerfile"), "tool")
    assert "unchanged since an earlier build" in again.stdout, again.stdout

    failing = project / "Failing"
    failing.write_text("FROM base\nRUN exit 7\n")
    failed = shoal_cli("template", "build", "-f", str(failing), "broken", check=False)
    assert failed.returncode == 1 and "Dockerfile line 2" in failed.stderr, failed

    assert shoal_cli("template", "rm", "tool").stdout == "tool: deleted\n"
    gone = shoal_cli("template", "rm", "tool", check=False)
    assert gone.returncode == 1 and "404" in gone.stderr, gone
    assert "tool " not in shoal_cli("template", "list").stdout
    # The build made its snapshot for the template alone: it went with it.
    live, snapshots = _leftovers(shoal, owner.token)
    assert live == [] and snapshots == [], (live, snapshots)


def test_an_operator_publishes_a_template_to_every_account(shoal, make_account):
    """`shoal template publish`: another account lists the template, creates
    sandboxes from it by name and cannot delete it; taken back, it is 404
    to them again."""
    from conftest import shoal_bin

    owner = make_account("team", "builds-publisher")
    other = make_account("team", "builds-user")
    owner_client = shoal.client(owner.token)
    other_client = shoal.client(other.token)
    build = owner_client.templates.build_from_dockerfile(
        "lab-stack", "FROM base\nRUN echo shared-toolchain > /opt/toolchain.txt\n"
    )
    assert owner_client.templates.wait_for_build(build.id, poll_interval=0.2, timeout_seconds=600).status == "done"
    with pytest.raises(NotFoundError):
        other_client.templates.get("lab-stack")

    def publish(*extra):
        done = subprocess.run(
            [shoal_bin(), "template", "publish", "lab-stack", "--account", owner.name,
             "--database-url", shoal.database_url, *extra],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, (done.stdout, done.stderr)
        return done.stdout

    assert publish() == "lab-stack: published to every account\n"
    seen = {t.name: t for t in other_client.templates.list()}
    assert seen["lab-stack"].is_global, seen["lab-stack"]
    assert other_client.templates.get("lab-stack").name == "lab-stack"
    sandbox = other_client.sandboxes.create(template="lab-stack")
    try:
        assert sandbox.exec("cat /opt/toolchain.txt").stdout == "shared-toolchain\n"
    finally:
        sandbox.kill()
    # Still the owner's: another account cannot delete it.
    r = shoal.http(other.token).delete(f"{shoal.url}/v1/templates/lab-stack", timeout=30)
    assert r.status_code == 404, r.text

    assert publish("--undo") == "lab-stack: its account's alone\n"
    with pytest.raises(NotFoundError):
        other_client.templates.get("lab-stack")
    with pytest.raises(PandastackError):
        other_client.sandboxes.create(template="lab-stack")
    owner_client.templates.delete("lab-stack")
    live, snapshots = _leftovers(shoal, owner.token)
    assert live == [] and snapshots == [], (live, snapshots)


def test_a_changed_build_reuses_its_unchanged_prefix(shoal, make_account):
    owner = make_account("team", "builds-layers")
    client = shoal.client(owner.token)
    slow = "RUN sleep 2 && echo slow-step-ran && echo one > /one\n"
    first = "FROM base\nENV STAGE=one\n" + slow + "RUN echo two > /two\n"
    build = client.templates.build_from_dockerfile("layered", first)
    build = client.templates.wait_for_build(build.id, poll_interval=0.5, timeout_seconds=600)
    first_log = list(client.templates.build_logs(build.id, follow=False))
    assert build.status == "done" and "slow-step-ran" in first_log, first_log

    # The last step changes: the ENV and the slow RUN come from the layer
    # the first build left, and only the changed step runs.
    second = "FROM base\nENV STAGE=one\n" + slow + "RUN echo changed > /two\n"
    build = client.templates.build_from_dockerfile("layered", second)
    build = client.templates.wait_for_build(build.id, poll_interval=0.5, timeout_seconds=600)
    log = list(client.templates.build_logs(build.id, follow=False))
    assert build.status == "done", log
    assert any("steps 1-2 are those of an earlier build" in l for l in log), log
    assert "slow-step-ran" not in log, log
    sandbox = client.sandboxes.create(template="layered")
    try:
        assert sandbox.exec('cat /one /two; echo "$STAGE"').stdout == "one\nchanged\none\n"
    finally:
        sandbox.kill()

    # Another account's identical Dockerfile restores none of it.
    other = shoal.client(make_account("team", "builds-layers-other").token)
    build = other.templates.build_from_dockerfile("layered", second)
    build = other.templates.wait_for_build(build.id, poll_interval=0.5, timeout_seconds=600)
    log = list(other.templates.build_logs(build.id, follow=False))
    assert build.status == "done" and "slow-step-ran" in log, log


def test_a_dockerfile_from_another_debian_release_runs_on_that_release(shoal, make_account):
    """`FROM debian:trixie`: the host bootstraps Debian 13 itself (once; the
    template debian-trixie), and the build and its sandboxes run on it."""
    owner = make_account("team", "builds-trixie")
    client = shoal.client(owner.token)
    dockerfile = "FROM debian:trixie\nRUN cat /etc/debian_version > /etc/built-on\n"
    build = client.templates.build_from_dockerfile("on-trixie", dockerfile)
    build = client.templates.wait_for_build(build.id, poll_interval=1, timeout_seconds=1800)
    log = list(client.templates.build_logs(build.id, follow=False))
    assert build.status == "done", (build, log)

    sandbox = client.sandboxes.create(template="on-trixie")
    try:
        out = sandbox.exec(". /etc/os-release; echo $VERSION_CODENAME; cat /etc/built-on")
        codename, built_on = out.stdout.split()
        assert codename == "trixie" and built_on.startswith("13"), out.stdout
    finally:
        sandbox.kill()
    # Baked once: it is listed, and the same build again is a cache hit.
    assert "debian-trixie" in [t.name for t in client.templates.list() if t.is_global]
    again = client.templates.build_from_dockerfile("on-trixie", dockerfile)
    again = client.templates.wait_for_build(again.id, poll_interval=0.5, timeout_seconds=120)
    assert any("cache hit" in l for l in client.templates.build_logs(again.id, follow=False))

    with pytest.raises(PandastackError) as unknown:
        client.templates.build_from_dockerfile("old", "# an old release\nFROM debian:buster\n")
    assert "line 2" in str(unknown.value) and "bullseye" in str(unknown.value), unknown.value

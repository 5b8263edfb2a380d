"""Sizes (issue 21). A template's `cpu` and `memory_mb` (a build's) are
what its sandboxes get; `cpu` and `memory_mb` on a raw create (the SDK no
longer sends them: it bakes sizes into templates) give a VM of that size,
at most its template's. Inside, `nproc` and `MemTotal` show it. The first
create at a size boots the template's disk once at that size; later ones
restore what it saved. A size above the template's, or too little memory to
run, is a 422 and leaves nothing."""

import time

import pytest

from pandastack import PandastackError


def _mem_kib(sandbox):
    return int(sandbox.exec("awk '/MemTotal/ {print $2}' /proc/meminfo").stdout.strip())


def _create(shoal, token, client, **body):
    body.setdefault("template", "base")
    r = shoal.http(token).post(f"{shoal.url}/v1/sandboxes", json=body, timeout=300)
    if r.status_code != 201:
        raise PandastackError(r.text)
    return client.sandboxes.get(r.json()["id"])


def test_a_templates_size_is_what_its_sandboxes_get(shoal, make_account):
    client = shoal.client(make_account("team", "sizes-template").token)
    build = client.templates.build_from_dockerfile("two-cpus", "FROM base\nRUN echo sized > /etc/sized\n", cpu=2, memory_mb=1024)
    build = client.templates.wait_for_build(build.id, poll_interval=0.5, timeout_seconds=600)
    assert build.status == "done", list(client.templates.build_logs(build.id, follow=False))
    template = client.templates.get("two-cpus")
    assert (template.cpu, template.memory_mb) == (2, 1024), template
    sandbox = client.sandboxes.create(template="two-cpus")
    try:
        assert sandbox.exec("nproc; cat /etc/sized").stdout == "2\nsized\n"
        assert 850_000 <= _mem_kib(sandbox) <= 1_048_576
    finally:
        sandbox.kill()


def test_cpu_and_memory_on_create_size_the_vm(shoal, make_account):
    owner = make_account("team", "sizes")
    client = shoal.client(owner.token)
    full = client.sandboxes.create(template="base")
    try:
        full_cpus = int(full.exec("nproc").stdout)
        full_kib = _mem_kib(full)
    finally:
        full.kill()

    started = time.monotonic()
    small = _create(shoal, owner.token, client, cpu=2, memory_mb=1024)
    first_s = time.monotonic() - started
    try:
        assert int(small.exec("nproc").stdout) == 2
        assert 850_000 <= _mem_kib(small) <= 1_048_576
        assert small.cpu == 2 and small.memory_mb == 1024, (small.cpu, small.memory_mb)
    finally:
        small.kill()
    assert full_cpus == 8 and full_kib > 3_000_000, (full_cpus, full_kib)

    # The second at that size restores the saved boot: create time again.
    started = time.monotonic()
    again = _create(shoal, owner.token, client, cpu=2, memory_mb=1024)
    again_s = time.monotonic() - started
    try:
        assert int(again.exec("nproc").stdout) == 2
    finally:
        again.kill()
    print(f"first create at 2 vCPUs/1 GiB {first_s:.1f} s (a boot), second {again_s:.2f} s")
    assert again_s < 5, again_s


def test_a_size_above_the_template_or_too_small_is_refused(shoal, make_account):
    owner = make_account("team", "sizes-bad")
    client = shoal.client(owner.token)
    for size in [{"cpu": 64}, {"memory_mb": 1 << 20}, {"cpu": 0}, {"memory_mb": 16}]:
        r = shoal.http(owner.token).post(f"{shoal.url}/v1/sandboxes", json=dict(template="base", **size), timeout=60)
        assert r.status_code == 422 and "at most its template's size" in r.json()["error"], (size, r.text)
    body = shoal.http(owner.token).get(f"{shoal.url}/v1/sandboxes", timeout=30).json()
    assert body == [], body


def test_a_smaller_copy_of_a_template_with_a_start_command_has_it_running(shoal, make_account):
    """The copy at another size is a fresh boot of the template's disk: the
    template's start command and readiness check run in it before it is
    saved, as in the template's own bake, so its sandboxes have the process
    running with no exec of their own."""
    owner = make_account("team", "sizes-start")
    client = shoal.client(owner.token)
    dockerfile = (
        "FROM base\n"
        'HEALTHCHECK CMD test -s /run/started-by-template\n'
        'CMD ["sh", "-c", "nproc > /run/started-by-template; exec sleep 1000000"]\n'
    )
    build = client.templates.build_from_dockerfile("started", dockerfile)
    build = client.templates.wait_for_build(build.id, poll_interval=0.5, timeout_seconds=600)
    assert build.status == "done", build
    for size in [{}, {"cpu": 2, "memory_mb": 1024}]:
        sandbox = _create(shoal, owner.token, client, **dict(size, template="started"))
        try:
            out = sandbox.exec("cat /run/started-by-template; pgrep -x sleep > /dev/null && echo running")
            lines = out.stdout.split()
            assert lines == [str(size.get("cpu", 8)), "running"], (size, out.stdout, out.stderr)
        finally:
            sandbox.kill()

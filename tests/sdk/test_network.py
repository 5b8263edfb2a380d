"""`allow_internet` in a raw create body (the SDK has no argument for it): a
guest reaches the outside only when it is true (the default), and a fork child
keeps its parent's choice.

This machine need not have a route to the internet, so the test makes a
stand-in: a network namespace, reached through a veth pair from the host, at
an address of 198.18.0.0/15 (benchmarking space: not among the private ranges
no sandbox may reach), with a TCP service that answers `outside <peer>`."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from conftest import RUN_ID
from sdkhelpers import error_of

PORT = 8080
SERVICE = f"""
import socket
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("0.0.0.0", {PORT}))
listener.listen(16)
print("ready", flush=True)
while True:
    connection, (peer, _) = listener.accept()
    connection.sendall(("outside " + peer + "\\n").encode())
    connection.close()
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Outside:
    def __init__(self) -> None:
        self.netns = f"shoal-sdk-out-{RUN_ID}"
        self.veth = f"sdko{RUN_ID[:8]}"  # at most 15 characters
        for _ in range(20):
            octet = random.randrange(256)
            if not subprocess.run(["ip", "-4", "route", "show", f"198.18.{octet}.0/24"],
                                  capture_output=True, text=True).stdout.strip():
                break
        else:
            raise RuntimeError("no free /24 in 198.18.0.0/16")
        self.address = f"198.18.{octet}.1"
        self.host_address = f"198.18.{octet}.254"
        self.service = None

    def start(self) -> None:
        ip("netns", "add", self.netns)
        ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        ip("addr", "add", f"{self.host_address}/24", "dev", self.veth)
        ip("link", "set", self.veth, "up")
        for args in (("link", "set", "lo", "up"), ("addr", "add", f"{self.address}/24", "dev", "eth0"),
                     ("link", "set", "eth0", "up"), ("route", "add", "default", "via", self.host_address)):
            ip("-n", self.netns, *args)
        self.service = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, sys.executable, "-u", "-c", SERVICE],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.service.stdout.readline().strip() == "ready"

    def stop(self) -> None:
        if self.service is not None:
            try:
                os.killpg(self.service.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.service.wait(timeout=10)
        subprocess.run(["ip", "link", "delete", self.veth], capture_output=True)
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True)


@pytest.fixture(scope="module")
def outside():
    served = Outside()
    try:
        served.start()
        yield served
    finally:
        served.stop()


def reach(sb, address: str) -> tuple:
    """(exit code, what the guest read) of a TCP connection from the guest (python3-minimal has socket)."""
    probe = (f"import socket; s = socket.create_connection(('{address}', {PORT}), timeout=3); "
             "print(s.recv(100).decode().strip())")
    result = sb.exec(f'python3 -c "{probe}"', timeout_seconds=30)
    return result.exit_code, result.stdout.strip()


def create(shoal, http, client, sandboxes, **body):
    r = http.post(f"{shoal.url}/v1/sandboxes", json={"template": "base", **body}, timeout=60)
    assert r.status_code == 201, r.text
    return sandboxes.track(client.sandboxes.get(r.json()["id"]))


def test_allow_internet_decides_whether_the_guest_reaches_the_outside(shoal, http, client, sandboxes, outside):
    opened = create(shoal, http, client, sandboxes, allow_internet=True)
    closed = create(shoal, http, client, sandboxes, allow_internet=False)
    default = sandboxes()  # the SDK never sends the field: true

    # Masqueraded: the outside sees the host's address on its link.
    assert reach(opened, outside.address) == (0, f"outside {outside.host_address}")
    assert reach(default, outside.address) == (0, f"outside {outside.host_address}")
    started = time.monotonic()
    code, out = reach(closed, outside.address)
    assert code != 0 and "outside" not in out, (code, out)
    assert time.monotonic() - started < 20

    # A fork child keeps its parent's choice.
    closed_child = sandboxes.track(closed.fork())
    code, out = reach(closed_child, outside.address)
    assert code != 0 and "outside" not in out, (code, out)
    open_child = sandboxes.track(opened.fork())
    assert reach(open_child, outside.address) == (0, f"outside {outside.host_address}")


def test_allow_internet_of_the_wrong_type_is_400(shoal, http, client):
    before = {s.id for s in client.sandboxes.list()}
    for value in ("no", 0, [True]):
        r = http.post(f"{shoal.url}/v1/sandboxes", json={"template": "base", "allow_internet": value}, timeout=60)
        assert r.status_code == 400, (value, r.text)
        error_of(r)
    assert {s.id for s in client.sandboxes.list()} == before

"""logs() (the guest console, plain and followed) and preview_urls() (the ports listening in the guest)."""

import queue
import threading
import time
import uuid

import pytest

from pandastack import BadRequestError
from sdkhelpers import error_of, wait_until


@pytest.fixture(scope="module")
def sb(module_sandboxes):
    return module_sandboxes(metadata={"suite": "sdk-logs-ports"})


def to_console(sb, text: str) -> None:
    """A line on the guest's serial console (what the logs route serves)."""
    assert sb.exec(f"printf '%s\\n' '{text}' > /dev/ttyS0").exit_code == 0


def test_logs_return_the_guest_console(shoal, account, sb):
    marker = f"shoal-logs-{uuid.uuid4().hex[:8]}"
    # A kernel message at a level that reaches the console despite `quiet`, and a line written to it directly.
    assert sb.exec(f"echo '<2>{marker}-kernel' > /dev/kmsg").exit_code == 0
    to_console(sb, f"{marker}-tty h\u00e9llo \u2713")
    wait_until(lambda: f"{marker}-tty h\u00e9llo \u2713" in list(sb.logs()), 10, "the console line in logs()")
    lines = list(sb.logs())
    assert any(line.endswith(f"] {marker}-kernel") for line in lines), lines[-20:]
    # The console has one stream: every `stream` gives the same log.
    for stream in ("stdout", "stderr", "both"):
        assert f"{marker}-tty h\u00e9llo \u2713" in list(sb.logs(stream=stream))

    http = shoal.http(account.token)
    r = http.get(f"{shoal.url}/v1/sandboxes/{sb.id}/logs", params={"follow": "0"}, timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; charset=utf-8"
    assert f"{marker}-tty h\u00e9llo \u2713\r\n".encode() in r.content or \
        f"{marker}-tty h\u00e9llo \u2713\n".encode() in r.content
    for query in ({"stream": "stdin"}, {"follow": "yes"}):
        r = http.get(f"{shoal.url}/v1/sandboxes/{sb.id}/logs", params=query, timeout=30)
        assert r.status_code == 400, (query, r.text)
        error_of(r)
    with pytest.raises(BadRequestError):
        list(sb.logs(stream="stdin"))


def test_logs_follow_streams_new_lines_until_the_sandbox_is_deleted(sandboxes):
    sb = sandboxes(metadata={"case": "logs-follow"})
    marker = f"shoal-follow-{uuid.uuid4().hex[:8]}"
    to_console(sb, f"{marker}-early")
    got: "queue.Queue" = queue.Queue()
    ended = object()

    def follow() -> None:
        try:
            for line in sb.logs(follow=True):
                got.put(line)
            got.put(ended)
        except Exception as error:  # handed to the test's thread
            got.put(error)

    threading.Thread(target=follow, daemon=True).start()

    def wait_for(wanted, seconds: float):
        seen = []
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            try:
                item = got.get(timeout=max(left, 0.01))
            except queue.Empty:
                raise AssertionError(f"logs(follow=True) did not yield {wanted!r} in {seconds} s; got {seen}")
            if isinstance(item, Exception):
                raise item
            if item is ended and wanted is not ended:
                raise AssertionError(f"logs(follow=True) ended before {wanted!r}; it yielded {seen}")
            if item is wanted or (isinstance(item, str) and item == wanted):
                return
            seen.append(item)

    wait_for(f"{marker}-early", 10)  # the log so far
    to_console(sb, f"{marker}-later")
    wait_for(f"{marker}-later", 10)  # then new lines as they come
    sb.kill()
    wait_for(ended, 15)  # and the stream ends with the sandbox


LISTENER = """
import socket, sys, time
v4 = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
v4.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
v4.bind(("0.0.0.0", 8123))
v4.listen()
v6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
v6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
v6.bind(("::1", 8124))
v6.listen()
bound = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
bound.bind(("127.0.0.1", 8125))  # bound, never listening
client = socket.create_connection(("127.0.0.1", 8123))  # an established connection
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("0.0.0.0", 8126))
print("listening", client.getsockname()[1], flush=True)
time.sleep(600)
"""


def test_ports_lists_what_listens_in_the_guest(shoal, account, sb):
    assert sb.preview_urls() == {}
    sb.filesystem.write("/root/listener.py", LISTENER)
    pid = sb.exec("setsid python3 /root/listener.py </dev/null >/root/listener.out 2>&1 & echo $!").stdout.strip()
    assert pid.isdigit()
    wait_until(lambda: sb.exec("cat /root/listener.out").stdout.startswith("listening"), 20, "the listener")
    client_port = int(sb.exec("cat /root/listener.out").stdout.split()[1])

    urls = sb.preview_urls()
    assert sorted(urls) == [8123, 8124], urls
    assert urls[8123] == sb.preview_url(8123)
    r = shoal.http(account.token).get(f"{shoal.url}/v1/sandboxes/{sb.id}/ports", timeout=30)
    assert r.status_code == 200
    body = r.json()
    listed = body["ports"] if isinstance(body, dict) else body  # either shape the SDK reads
    assert [(p["port"], p["protocol"], p["listening"]) for p in listed] == [(8123, "tcp", True), (8124, "tcp", True)]
    assert client_port not in urls

    assert sb.exec(f"kill {pid}").exit_code == 0
    wait_until(lambda: sb.preview_urls() == {}, 10, "the ports to close with the listener")

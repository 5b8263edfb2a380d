"""exec, its timeout, and exec_stream (Server-Sent Events)."""

import time

import pytest
import requests

from pandastack import CommandFailed, SandboxTimeout
from sdkhelpers import pids_matching, wait_until


@pytest.fixture(scope="module")
def sb(module_sandboxes):
    return module_sandboxes(metadata={"suite": "sdk-exec"})


def test_exec_returns_stdout_stderr_and_exit_code(sb):
    result = sb.exec("echo hello; echo oops >&2; exit 3")
    assert result.stdout == "hello\n"
    assert result.stderr == "oops\n"
    assert result.exit_code == 3
    assert isinstance(result.duration_ms, int) and result.duration_ms >= 0


def test_exec_runs_one_shell_string(sb):
    result = sb.exec("x=$((6 * 7)); printf '%s|' \"$x\" 'a b' | tr '|' '\\n'")
    assert result.stdout == "42\na b\n"
    assert result.exit_code == 0


def test_nonzero_exit_is_a_result_and_check_raises_command_failed(sb):
    assert sb.exec("false").exit_code == 1
    with pytest.raises(CommandFailed) as failed:
        sb.exec("echo partial; exit 7", check=True)
    assert failed.value.exit_code == 7
    assert failed.value.stdout == "partial\n"


def test_commands_run_and_run_code_go_through_exec(sb):
    assert sb.commands.run("echo via-commands", timeout=10).stdout == "via-commands\n"
    assert sb.run_code("echo $((40 + 2))", language="bash").stdout == "42\n"


def test_exec_timeout_raises_sandbox_timeout_and_kills_the_command(sb):
    started = time.monotonic()
    with pytest.raises(SandboxTimeout):
        sb.exec("sleep 31", timeout_seconds=2)
    assert time.monotonic() - started < 20
    wait_until(lambda: pids_matching(sb, "sleep 3[1]") == [], 5, "the timed-out command to be killed")
    assert sb.exec("echo still-usable").stdout == "still-usable\n"


def test_exec_stream_delivers_chunks_as_they_happen_then_the_exit_code(sb):
    arrivals = []
    started = time.monotonic()
    code = sb.exec_stream(
        "echo first; sleep 2; echo second; exit 4",
        on_stdout=lambda chunk: arrivals.append((time.monotonic() - started, chunk)),
    )
    finished = time.monotonic() - started
    assert code == 4
    assert "".join(chunk for _, chunk in arrivals) == "first\nsecond\n"
    first_seen = next(at for at, chunk in arrivals if "first" in chunk)
    assert first_seen < finished - 1.5, f"'first' arrived at {first_seen:.2f} s, the stream ended at {finished:.2f} s"


def test_exec_stream_separates_stderr_and_keeps_non_ascii_intact(sb):
    out, err = [], []
    text = "héllo Å ✓ \u2028 日本"
    code = sb.exec_stream(f"printf '%s\\n' '{text}'; echo warn >&2", on_stdout=out.append, on_stderr=err.append)
    assert code == 0
    assert "".join(out) == text + "\n"
    assert "".join(err) == "warn\n"


def test_exec_stream_timeout_raises_sandbox_timeout(sb):
    started = time.monotonic()
    with pytest.raises(SandboxTimeout):
        sb.exec_stream("echo started; sleep 31", timeout_seconds=2)
    assert time.monotonic() - started < 20
    wait_until(lambda: pids_matching(sb, "sleep 3[1]") == [], 5, "the timed-out command to be killed")


KEEP_ALIVE_SECONDS = 15


def test_exec_stream_sends_keep_alives_through_a_silent_command(shoal, account, sb):
    """A command silent for longer than the keep-alive interval: the stream
    carries `: keep-alive` comments meanwhile, then the rest of the output."""
    started = time.monotonic()
    seen = []
    with requests.post(f"{shoal.url}/v1/sandboxes/{sb.id}/exec/stream",
                       json={"cmd": f"echo before; sleep {KEEP_ALIVE_SECONDS + 2}; echo after"},
                       headers={"Authorization": f"Bearer {account.token}", "Accept": "text/event-stream"},
                       stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines(decode_unicode=True):
            seen.append((time.monotonic() - started, line))
    lines = [line for _, line in seen]
    comments = [(at, line) for at, line in seen if line.startswith(":")]
    assert comments, lines
    assert all(line[1:].strip() == "keep-alive" for _, line in comments), comments
    before = next(at for at, line in seen if line.startswith("data:") and "before" in line)
    after = next(at for at, line in seen if line.startswith("data:") and "after" in line)
    first = comments[0][0]
    assert before < first < after, seen
    assert KEEP_ALIVE_SECONDS - 1.5 <= first - before <= KEEP_ALIVE_SECONDS + 1.5, seen
    events = [line for line in lines if line.startswith(("event:", "data:"))]
    assert events[-2:] == ["event: exit", 'data: {"exit_code":0}'], events


class Disconnect(Exception):
    pass


def test_exec_stream_kills_the_command_when_the_client_goes_away(sb):
    """The SDK closes the response when a callback raises: the command, silent
    from then on, must be killed at once, not when it next writes (the server
    sees the closed connection at once: a command that keeps printing is
    killed within a fraction of a second)."""
    sb.exec("rm -f /tmp/after-disconnect")

    def on_stdout(chunk):
        if "started" in chunk:
            raise Disconnect()

    with pytest.raises(Disconnect):
        sb.exec_stream("echo started; sleep 1033; touch /tmp/after-disconnect", on_stdout=on_stdout)
    wait_until(lambda: pids_matching(sb, "sleep 103[3]") == [], 10,
               "the command of a stream whose client went away to be killed")
    assert not sb.filesystem.exists("/tmp/after-disconnect")

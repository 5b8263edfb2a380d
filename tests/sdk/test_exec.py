"""exec, its timeout, and exec_stream (Server-Sent Events)."""

import time

import pytest

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

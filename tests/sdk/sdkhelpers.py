"""Small helpers shared by the SDK tests (no fixtures here; those are in conftest.py)."""

import datetime
import re
import time
from typing import Callable, List


def parse_time(value: str) -> datetime.datetime:
    """An RFC 3339 timestamp, with any number of fractional digits, as an aware datetime."""
    value = value.strip().replace("Z", "+00:00").replace("z", "+00:00")
    value = re.sub(r"(\.\d{6})\d+", r"\1", value)
    parsed = datetime.datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise AssertionError(f"timestamp without a time zone: {value!r}")
    return parsed


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def error_of(response) -> str:
    """Assert the response is Shoal's JSON error body and return its message."""
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"].strip(), body
    return body["error"]


def pids_matching(sandbox, pattern: str) -> List[str]:
    """Pids of guest processes whose command line matches an extended regex,
    found through /proc (needs only coreutils and grep). The pattern must not
    match its own text, or the searching shell finds itself: write
    `sleep 3[1]` to find `sleep 31`."""
    script = (
        "for p in /proc/[0-9]*; do "
        "c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null) && printf '%s %s\\n' \"${p#/proc/}\" \"$c\"; "
        f"done | grep -E '{pattern}' | cut -d' ' -f1"
    )
    return sandbox.exec(script).stdout.split()

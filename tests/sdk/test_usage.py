"""Metering: GET /v1/usage (rows, metadata and time filters, totals) and per-sandbox usage."""

import datetime
import math
import time
import uuid

import pytest

from sdkhelpers import error_of, parse_time

AMOUNTS = ("wall_seconds", "cpu_seconds", "gib_seconds", "cost")


def iso(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_row(row: dict) -> None:
    for key in AMOUNTS:
        assert isinstance(row[key], (int, float)) and not isinstance(row[key], bool), (key, row)
        assert row[key] >= 0 and math.isfinite(row[key]), (key, row)
    assert row["wall_seconds"] > 0 and row["gib_seconds"] > 0, row
    parse_time(row["created_at"])


def test_usage_rows_filter_by_metadata_and_time_with_totals(shoal, http, sandboxes):
    sweep = f"run-{uuid.uuid4().hex[:8]}"
    kept = sandboxes(metadata={"sweep": sweep, "part": "a"})
    gone = sandboxes(metadata={"sweep": sweep, "part": "b"})
    other = sandboxes(metadata={"sweep": f"{sweep}-other"})
    kept.exec("i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
    time.sleep(1.0)
    gone.kill()

    r = http.get(f"{shoal.url}/v1/usage", params={"metadata": f"sweep={sweep}"}, timeout=30)
    assert r.status_code == 200, r.text
    report = r.json()
    rows = {row["sandbox_id"]: row for row in report["items"]}
    assert set(rows) == {kept.id, gone.id}
    assert other.id not in rows
    for row in rows.values():
        check_row(row)
        assert row["metadata"]["sweep"] == sweep
        assert row["template"] == "base"
    assert rows[gone.id]["status"] == "deleted" and rows[gone.id]["ended_at"] is not None
    assert rows[kept.id]["ended_at"] is None
    assert report["currency"] == "USD"
    assert report["totals"]["sandboxes"] == 2
    for key in AMOUNTS:
        assert report["totals"][key] == pytest.approx(sum(row[key] for row in rows.values()), rel=1e-6, abs=1e-9)

    both = http.get(f"{shoal.url}/v1/usage", params=[("metadata", f"sweep={sweep}"), ("metadata", "part=b")],
                    timeout=30).json()
    assert [row["sandbox_id"] for row in both["items"]] == [gone.id]

    now = datetime.datetime.now(datetime.timezone.utc)
    future = http.get(f"{shoal.url}/v1/usage", timeout=30, params={
        "metadata": f"sweep={sweep}", "from": iso(now + datetime.timedelta(hours=1)),
        "to": iso(now + datetime.timedelta(hours=2))}).json()
    assert future["items"] == [] and future["totals"]["sandboxes"] == 0
    around = http.get(f"{shoal.url}/v1/usage", timeout=30, params={
        "metadata": f"sweep={sweep}", "from": iso(now - datetime.timedelta(hours=1)),
        "to": iso(now + datetime.timedelta(minutes=1))}).json()
    assert {row["sandbox_id"] for row in around["items"]} == {kept.id, gone.id}

    backwards = http.get(f"{shoal.url}/v1/usage", timeout=30, params={
        "from": iso(now), "to": iso(now - datetime.timedelta(hours=1))})
    assert backwards.status_code == 400
    error_of(backwards)


def test_per_sandbox_usage(shoal, http, sandboxes):
    sb = sandboxes(metadata={"sweep": "single"})
    time.sleep(0.5)
    r = http.get(f"{shoal.url}/v1/sandboxes/{sb.id}/usage", timeout=30)
    assert r.status_code == 200, r.text
    row = r.json()
    assert row["sandbox_id"] == sb.id
    assert row["metadata"] == {"sweep": "single"}
    assert row["status"] == "running"
    check_row(row)
    later = http.get(f"{shoal.url}/v1/sandboxes/{sb.id}/usage", timeout=30).json()
    assert later["wall_seconds"] >= row["wall_seconds"]

"""Code-interpreter sessions: state kept between runs, rich results (PNG, HTML)."""

import base64
import time

import pytest

from pandastack import BadRequestError, NotFoundError, SandboxTimeout
from sdkhelpers import error_of

# Importing pandas or matplotlib in a guest emulated by TCG takes a while; give
# these calls room beyond the SDK's 30 s default.
SLOW_CELL = 240


@pytest.fixture(scope="module")
def sb(shoal, account, module_sandboxes):
    slow_client = shoal.client(account.token, timeout=SLOW_CELL + 60)
    return module_sandboxes("code-interpreter", client=slow_client, metadata={"suite": "sdk-repl"})


@pytest.fixture
def ctx(sb):
    with sb.create_code_context() as context:
        yield context


def test_state_is_kept_between_runs(ctx):
    assert isinstance(ctx.id, str) and ctx.id
    assert ctx.language == "python"
    first = ctx.run_code("x = 41\nimport math")
    assert first.error is None and first.exit_code == 0
    assert first.results == []

    second = ctx.run_code("print(x)\nmath.floor(x + 1.5)")
    assert second.stdout == "41\n"
    assert second.text == "42"
    assert second.error is None


def test_sessions_are_independent(sb, ctx):
    ctx.run_code("only_here = 1")
    with sb.create_code_context() as other:
        result = other.run_code("only_here")
    assert result.error is not None and "NameError" in result.error
    assert ctx.run_code("only_here").text == "1"


def test_matplotlib_figure_comes_back_as_png(ctx):
    result = ctx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('shoal')\nplt.show()",
        timeout_seconds=SLOW_CELL,
    )
    assert result.error is None, result.error
    assert result.png is not None
    assert base64.b64decode(result.png, validate=True).startswith(b"\x89PNG\r\n\x1a\n")
    assert ctx.run_code("import matplotlib.pyplot as plt\nlen(plt.get_fignums())").text == "0"


def test_dataframe_comes_back_as_html(ctx):
    result = ctx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})",
                          timeout_seconds=SLOW_CELL)
    assert result.error is None, result.error
    html = next(r.html for r in result.results if r.html is not None)
    assert "<table" in html and "<td>x</td>" in html
    assert "a" in result.text and "b" in result.text


def test_an_exception_is_reported_and_the_session_survives(ctx):
    ctx.run_code("kept = 'yes'")
    failed = ctx.run_code("1 / 0")
    assert failed.error is not None and "ZeroDivisionError" in failed.error
    assert failed.exit_code == 1
    assert ctx.run_code("kept").text == "'yes'"


def test_a_closed_session_is_gone(sb):
    context = sb.create_code_context("python3")
    assert context.run_code("1 + 1").text == "2"
    context.close()
    with pytest.raises(NotFoundError):
        context.run_code("1 + 1")


MAX_SESSIONS = 8


def test_a_ninth_session_is_409_until_one_closes(shoal, account, sb):
    http = shoal.http(account.token)
    url = f"{shoal.url}/v1/sandboxes/{sb.id}/repl/sessions"
    opened = []
    try:
        for _ in range(MAX_SESSIONS):
            opened.append(sb.create_code_context())
        r = http.post(url, json={"language": "python"}, timeout=60)
        assert r.status_code == 409, r.text
        assert error_of(r)
        with pytest.raises(BadRequestError):
            sb.create_code_context()
        # Every one of the eight still works, and closing one frees its place.
        assert [ctx.run_code(f"{i} * 2").text for i, ctx in enumerate(opened)] == [
            str(i * 2) for i in range(MAX_SESSIONS)]
        opened.pop().close()
        again = sb.create_code_context()
        opened.append(again)
        assert again.run_code("'ninth'").text == "'ninth'"
    finally:
        for ctx in opened:
            ctx.close()


def test_a_cell_past_its_timeout_is_504_and_the_session_survives(shoal, account, sb, ctx):
    ctx.run_code("kept = 'before'")
    started = time.monotonic()
    with pytest.raises(SandboxTimeout):
        ctx.run_code("import time\ntime.sleep(60)", timeout_seconds=1)
    assert time.monotonic() - started < 15
    r = shoal.http(account.token).post(
        f"{shoal.url}/v1/sandboxes/{sb.id}/repl/sessions/{ctx.id}/run",
        json={"code": "while True:\n    pass", "timeout_ms": 1500}, timeout=60)
    assert r.status_code == 504, r.text
    assert error_of(r) == "cell timeout after 1.5s"
    assert ctx.run_code("kept").text == "'before'"


@pytest.mark.parametrize("language", ["javascript", "r", "bash", ""])
def test_an_unsupported_language_is_400(shoal, account, sb, language):
    r = shoal.http(account.token).post(f"{shoal.url}/v1/sandboxes/{sb.id}/repl/sessions",
                                       json={"language": language}, timeout=60)
    assert r.status_code == 400, r.text
    assert error_of(r) == f"unsupported language: {language}"
    with pytest.raises(BadRequestError) as refused:
        sb.create_code_context(language or "ruby")
    assert "unsupported language" in str(refused.value)

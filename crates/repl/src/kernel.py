"""Shoal's repl kernel: one long-lived Python interpreter whose state
persists between cells, like a Jupyter kernel.

Started by the host (crate shoal-repl) as `python3 -u -c <this file>`.
Standard library only; matplotlib and pandas are used when the user's code
imports them.

Wire protocol (all on the process's original stdin/stdout, which the kernel
keeps on private descriptors; one JSON object per line, ASCII only):

  kernel -> host, once at start:   {"ready": true, "pid": int, "python": str}
  host -> kernel, one per cell:    {"id": int, "code": str}
  kernel -> host, one per request: {"id": int, "stdout": str, "stderr": str,
                                    "error": str|null, "exit_code": int,
                                    "results": [{mime: str}, ...]}
  a request the kernel cannot read: {"id": null, "protocol_error": str}

EOF on stdin ends the kernel. SIGINT interrupts the running cell (it raises
KeyboardInterrupt in it) and is ignored between cells.

User code sees: descriptor 0 and sys.stdin on /dev/null; descriptors 1 and
2 on capture files (so output of subprocesses and C code is captured as well
as print()), read back and emptied after every cell; `__name__ ==
"__main__"` in one persistent namespace, which is also sys.modules["__main__"].
"""

import os
import sys

# Before anything can import matplotlib: a headless backend, where
# plt.show() never blocks.
os.environ["MPLBACKEND"] = "Agg"

import ast
import base64
import builtins
import faulthandler
import fcntl
import io
import json
import linecache
import signal
import traceback
import types
import warnings

# Each captured stream keeps at most this much of a cell's output (half from
# its start, half from its end).
_MAX_STREAM = 8 * 1024 * 1024

# Rich representations of the IPython display protocol, in bundle order.
_REPR_METHODS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_json_", "application/json"),
    ("_repr_latex_", "text/latex"),
)
_BINARY_MIMES = ("image/png", "image/jpeg")

_FUTURE_FLAGS = 0
for _name in __import__("__future__").all_feature_names:
    _FUTURE_FLAGS |= getattr(__import__("__future__"), _name).compiler_flag
_TOP_LEVEL_AWAIT = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
_CO_COROUTINE = 0x80


def _clean(text):
    """A str that encodes as UTF-8 (lone surrogates escaped), so every JSON
    consumer accepts it."""
    if not isinstance(text, str):
        text = str(text)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class _Capture:
    """One of descriptors 1 and 2, pointed at an in-memory file (O_APPEND,
    so the kernel, its children and C code all add to the end)."""

    def __init__(self, target_fd, name):
        try:
            fd = os.memfd_create("shoal-repl-" + name)
        except (AttributeError, OSError):
            import tempfile

            keep = tempfile.TemporaryFile(buffering=0)
            fd = os.dup(keep.fileno())
            keep.close()
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_APPEND)
        os.dup2(fd, target_fd)  # inheritable, for subprocesses
        self.fd = fd
        self.target_fd = target_fd
        self.stream = io.TextIOWrapper(
            io.FileIO(target_fd, "w", closefd=False),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
        )

    def take(self):
        """Everything written since the last take, as text; empties it."""
        try:
            self.stream.flush()
        except Exception:
            pass
        size = os.fstat(self.fd).st_size
        if size <= _MAX_STREAM:
            data = self._read(0, size)
        else:
            half = _MAX_STREAM // 2
            data = (
                self._read(0, half)
                + b"\n[... %d bytes of output omitted ...]\n" % (size - 2 * half)
                + self._read(size - half, half)
            )
        os.ftruncate(self.fd, 0)
        return data.decode("utf-8", "replace")

    def _read(self, offset, length):
        chunks = []
        while length > 0:
            chunk = os.pread(self.fd, min(length, 1 << 20), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            length -= len(chunk)
        return b"".join(chunks)


class Kernel:
    def __init__(self):
        # The protocol's descriptors, private (not inherited) and away from
        # 0/1/2 so nothing the user runs can read or write them.
        self.requests = os.fdopen(os.dup(0), "rb")
        self.replies = os.dup(1)
        self.log = os.fdopen(os.dup(2), "w", buffering=1)
        faulthandler.enable(file=self.log)

        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        self.stdout = _Capture(1, "stdout")
        self.stderr = _Capture(2, "stderr")
        self.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")

        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        self.namespace = main.__dict__
        sys.argv = [""]

        self.running = False
        self.count = 0
        self.flags = 0
        self.loop = None
        signal.signal(signal.SIGINT, self._on_sigint)
        warnings.filterwarnings(
            "ignore", message="FigureCanvasAgg is non-interactive", category=UserWarning
        )

    def _on_sigint(self, signum, frame):
        if self.running:
            raise KeyboardInterrupt

    def send(self, message):
        line = json.dumps(message, ensure_ascii=True, separators=(",", ":")) + "\n"
        _write_all(self.replies, line.encode("ascii"))

    def serve(self):
        self.send({"ready": True, "pid": os.getpid(), "python": sys.version.split()[0]})
        while True:
            line = self.requests.readline()
            if not line:
                os._exit(0)
            if not line.strip():
                continue
            try:
                request = json.loads(line)
                code = request["code"]
                if not isinstance(code, str):
                    raise TypeError("code is not a string")
                cell_id = request.get("id")
            except Exception as e:
                self.send({"id": None, "protocol_error": "bad request: %s" % e})
                continue
            try:
                reply = self.run_cell(code)
            except KeyboardInterrupt:
                # A SIGINT that landed in the kernel's own code around the cell.
                self.running = False
                reply = self.finish([], "KeyboardInterrupt", 1)
            except BaseException:
                self.running = False
                reply = self.finish([], "shoal kernel error:\n" + traceback.format_exc(), 1)
            reply["id"] = cell_id
            self.send(reply)

    # -- one cell ---------------------------------------------------------

    def run_cell(self, code):
        sys.stdout = self.stdout.stream
        sys.stderr = self.stderr.stream
        sys.stdin = self.stdin
        results = []
        error = None
        exit_code = 0
        shown = None
        try:
            value, has_value = self.execute(code)
            if has_value and value is not None:
                bundle, shown = self.value_bundle(value)
                results.append(bundle)
        except SystemExit as e:
            exit_code = self.exit_code(e.code)
        except BaseException as e:
            error = self.format_error(e)
            exit_code = 1
        finally:
            self.running = False
        results.extend(self.figures(skip=shown))
        return self.finish(results, error, exit_code)

    def finish(self, results, error, exit_code):
        stdout = self.stdout.take()
        stderr = self.stderr.take()
        if error is not None:
            error = error.rstrip("\n")
            if stderr and not stderr.endswith("\n"):
                stderr += "\n"
            stderr += error + "\n"
        return {
            "stdout": _clean(stdout),
            "stderr": _clean(stderr),
            "error": None if error is None else _clean(error),
            "exit_code": exit_code,
            "results": results,
        }

    def execute(self, code):
        """Runs the cell; returns (value of the last statement, whether it
        was an expression)."""
        if not code.strip():
            return None, False
        self.count += 1
        filename = "<cell-%d>" % self.count
        # Tracebacks show the cell's lines.
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            tree = ast.parse(code, filename, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            body = self.compile(tree, filename, "exec") if tree.body else None
            tail = self.compile(last, filename, "eval") if last is not None else None
        except (SyntaxError, ValueError, OverflowError) as e:
            # Reported without the kernel's frames: just the error.
            raise e.with_traceback(None)
        if body is not None:
            self.call(body)
        if tail is not None:
            return self.call(tail), True
        return None, False

    def compile(self, tree, filename, mode):
        code = compile(tree, filename, mode, self.flags | _TOP_LEVEL_AWAIT, dont_inherit=True)
        self.flags |= code.co_flags & _FUTURE_FLAGS
        return code

    def call(self, code):
        self.running = True
        try:
            result = eval(code, self.namespace)
            if code.co_flags & _CO_COROUTINE:
                result = self.event_loop().run_until_complete(result)
            return result
        finally:
            self.running = False

    def event_loop(self):
        if self.loop is None or self.loop.is_closed():
            import asyncio

            self.loop = asyncio.new_event_loop()
        return self.loop

    def exit_code(self, code):
        if code is None:
            return 0
        if isinstance(code, int):
            return max(-(2**31), min(code, 2**31 - 1))
        print(code, file=sys.stderr)
        return 1

    def format_error(self, e):
        # Only the user's frames: not the kernel's (around the cell and the
        # SIGINT handler's), nor asyncio's above a top-level await.
        kept = []
        tb = e.__traceback__
        while tb is not None:
            if not (self.is_own_frame(tb) or (not kept and self.is_asyncio_frame(tb))):
                kept.append(tb)
            tb = tb.tb_next
        for outer, inner in zip(kept, kept[1:]):
            outer.tb_next = inner
        if kept:
            kept[-1].tb_next = None
        tb = kept[0] if kept else None
        if tb is None:
            return "".join(traceback.format_exception_only(type(e), e))
        return "".join(traceback.format_exception(type(e), e, tb))

    @staticmethod
    def is_own_frame(tb):
        return tb is not None and tb.tb_frame.f_globals is globals()

    @staticmethod
    def is_asyncio_frame(tb):
        module = tb.tb_frame.f_globals.get("__name__") or ""
        return module == "asyncio" or module.startswith("asyncio.")

    # -- rich results -----------------------------------------------------

    def value_bundle(self, value):
        """The MIME bundle of a cell's value, and the figure it is (if any),
        which is then not reported again among the open figures."""
        figure = sys.modules.get("matplotlib.figure")
        if figure is not None and isinstance(value, figure.Figure):
            bundle = self.figure_bundle(value)
            if bundle is not None:
                return bundle, value
        bundle = {"text/plain": _clean(repr(value))}
        if isinstance(value, type) or hasattr(value, "_ipython_canary_method_should_not_exist_"):
            # A class (its _repr_*_ are unbound) or an object that answers
            # every attribute: only its repr.
            return bundle, None
        rich = {}
        method = getattr(value, "_repr_mimebundle_", None)
        if callable(method):
            try:
                data = method(include=None, exclude=None)
                if isinstance(data, tuple):
                    data = data[0]
                if isinstance(data, dict):
                    for mime, item in data.items():
                        converted = self.mime_value(mime, item)
                        if converted is not None and mime != "text/plain":
                            rich[mime] = converted
            except Exception:
                pass
        for name, mime in _REPR_METHODS:
            if mime in rich:
                continue
            method = getattr(value, name, None)
            if not callable(method):
                continue
            try:
                converted = self.mime_value(mime, method())
            except Exception:
                continue
            if converted is not None:
                rich[mime] = converted
        bundle.update(rich)
        return bundle, None

    @staticmethod
    def mime_value(mime, data):
        """A display value as the wire carries it: base64 for images, JSON
        text for JSON, str for the rest; None when there is nothing."""
        if isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], dict):
            data = data[0]  # (data, metadata)
        if data is None:
            return None
        if mime in _BINARY_MIMES:
            if isinstance(data, (bytes, bytearray, memoryview)):
                return base64.b64encode(bytes(data)).decode("ascii")
            if isinstance(data, str):
                return "".join(data.split())  # already base64
            return None
        if mime == "application/json" or mime.endswith("+json"):
            if isinstance(data, str):
                return _clean(data)
            return _clean(json.dumps(data, default=str))
        if isinstance(data, (bytes, bytearray)):
            return _clean(bytes(data).decode("utf-8", "replace"))
        return _clean(data)

    def figures(self, skip=None):
        """A bundle per open matplotlib figure, oldest first; then closes
        them all."""
        if "matplotlib.pyplot" not in sys.modules:
            return []
        try:
            from matplotlib import _pylab_helpers
            import matplotlib.pyplot as plt

            managers = sorted(_pylab_helpers.Gcf.figs.items())
        except Exception:
            return []
        bundles = []
        for _, manager in managers:
            figure = manager.canvas.figure
            if figure is skip:
                continue
            bundle = self.figure_bundle(figure)
            if bundle is not None:
                bundles.append(bundle)
        try:
            plt.close("all")
        except Exception:
            pass
        return bundles

    def figure_bundle(self, figure):
        try:
            buf = io.BytesIO()
            figure.savefig(buf, format="png", bbox_inches="tight")
            return {
                "image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                "text/plain": _clean(repr(figure)),
            }
        except Exception:
            sys.stderr.write(traceback.format_exc())
            return None


if __name__ == "__main__":
    Kernel().serve()

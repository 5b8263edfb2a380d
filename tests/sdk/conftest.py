"""Fixtures for driving `shoal up` with the real, unmodified `pandastack` SDK.

Owns: starting `shoal up` as a subprocess in its own process group, waiting
for `GET /readyz`, minting tokens with `shoal token create`, SDK clients
bound to those tokens, and stopping exactly that process group afterwards
(SIGTERM, then SIGKILL after 15 s). Leaves everything about sandboxes to the
tests; `docs/api/CONTRACT.md` is what they hold the server to.

Environment:
  SHOAL_BIN             the shoal binary (default: <repo>/target/release/shoal)
  SHOAL_STATE_DIR       state dir of the main server (default: a fresh temp dir)
  SHOAL_DATABASE_URL    database of the main server (default: a SQLite file in the temp dir)
  SHOAL_CACHE_DIR       passed as --cache-dir when set (where baked templates live)
  SHOAL_GUEST_AGENT     read by `shoal up` itself: the guest agent to bake (scripts/test sets it)
  SHOAL_STARTUP_TIMEOUT seconds to wait for /readyz (default 300)
  SHOAL_KEEP_TMP=1      keep the temp dir (server logs) even when every test passed
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from typing import Callable, Iterator, List, Optional

import pytest
import requests

import pandastack
from pandastack import Client, NotFoundError, PandastackError

REPO = pathlib.Path(__file__).resolve().parents[2]
RUN_ID = uuid.uuid4().hex[:8]
STOP_GRACE_SECONDS = 15.0

_servers: List["ShoalServer"] = []
_tmp_root: Optional[pathlib.Path] = None


def shoal_bin() -> str:
    value = os.environ.get("SHOAL_BIN")
    if not value:
        return str(REPO / "target" / "release" / "shoal")
    if os.sep in value:
        return str(pathlib.Path(value).resolve())
    return shutil.which(value) or value


def tmp_root() -> pathlib.Path:
    """One short temp dir per run (QEMU and agent sockets live under state dirs)."""
    global _tmp_root
    if _tmp_root is None:
        base = os.environ.get("TMPDIR", "/tmp")
        _tmp_root = pathlib.Path(tempfile.mkdtemp(prefix="shoal-sdk-", dir=base))
    return _tmp_root


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sqlite_url(path: pathlib.Path) -> str:
    return f"sqlite:{path}"


class ShoalServer:
    """One `shoal up` process group and the tokens minted against its database."""

    def __init__(self, name: str, state_dir: pathlib.Path, database_url: str, extra_args: tuple = ()):
        self.name = name
        self.state_dir = state_dir
        self.database_url = database_url
        self.extra_args = list(extra_args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_root() / f"{name}.log"
        self.proc: Optional[subprocess.Popen] = None

    def command(self) -> List[str]:
        cmd = [
            shoal_bin(), "up",
            "--listen", f"127.0.0.1:{self.port}",
            "--state-dir", str(self.state_dir),
            "--database-url", self.database_url,
        ]
        cache_dir = os.environ.get("SHOAL_CACHE_DIR")
        if cache_dir:
            cmd += ["--cache-dir", cache_dir]
        return cmd + self.extra_args

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.command(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        finally:
            log.close()
        _servers.append(self)
        deadline = time.monotonic() + float(os.environ.get("SHOAL_STARTUP_TIMEOUT", "300"))
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name}: `{' '.join(self.command())}` exited with {self.proc.returncode} "
                    f"before /readyz answered:\n{self.log_tail()}"
                )
            try:
                r = requests.get(f"{self.url}/readyz", timeout=2)
                if r.status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name}: /readyz did not answer 200 in time:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it if anything is left after 15 s."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while True:
            self.proc.poll()  # reap the leader so it does not keep the group alive as a zombie
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                print(f"\n{self.name}: process group {pgid} still alive {STOP_GRACE_SECONDS:.0f} s after SIGTERM; SIGKILL")
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            time.sleep(0.1)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def create_token(self, account: str, tier: str) -> str:
        """`shoal token create`; the token is the last line of stdout."""
        cmd = [shoal_bin(), "token", "create", "--account", account, "--tier", tier,
               "--database-url", self.database_url]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
        if not lines:
            raise RuntimeError(f"`{' '.join(cmd)}` printed no token")
        return lines[-1]

    def client(self, token: str, **kwargs) -> Client:
        return Client(api_url=self.url, api_key=token, **kwargs)

    def http(self, token: Optional[str] = None) -> requests.Session:
        """A raw HTTP session (for routes and headers the SDK does not expose)."""
        session = requests.Session()
        if token:
            session.headers["Authorization"] = f"Bearer {token}"
        return session


@dataclasses.dataclass(frozen=True)
class Account:
    name: str
    tier: str
    token: str


def _state_dir(suffix: str) -> pathlib.Path:
    given = os.environ.get("SHOAL_STATE_DIR")
    if given:
        return pathlib.Path(given.rstrip("/") + suffix) if suffix else pathlib.Path(given)
    return tmp_root() / f"state{suffix}"


@pytest.fixture(scope="session", autouse=True)
def _no_retry_budget_from_environment() -> Iterator[None]:
    """The tests choose the SDK's capacity-retry budget explicitly."""
    saved = os.environ.pop("PANDASTACK_MAX_CREATE_RETRY_SECONDS", None)
    yield
    if saved is not None:
        os.environ["PANDASTACK_MAX_CREATE_RETRY_SECONDS"] = saved


class Registry:
    """Debian's `docker-registry` (the CNCF distribution registry) on a free
    port of 127.0.0.1, in its own process group, storing under the temp dir."""

    def __init__(self) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        root = tmp_root() / "registry"
        root.mkdir(parents=True, exist_ok=True)
        self.config = root / "config.yml"
        self.config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
            f"http:\n  addr: {self.address}\n"
        )
        self.log_path = tmp_root() / "registry.log"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "serve", str(self.config)], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
            try:
                if requests.get(f"{self.url}/v2/", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"docker-registry did not answer: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=STOP_GRACE_SECONDS)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def push(self, repository: str, tag: str, blobs: dict, manifest: bytes, media_type: str) -> None:
        """Pushes `blobs` ({sha256 hex: bytes}) and `manifest` under `tag`,
        as `docker push` does, over the distribution API."""
        for digest, data in blobs.items():
            started = requests.post(f"{self.url}/v2/{repository}/blobs/uploads/", timeout=30)
            assert started.status_code == 202, started.text
            location = started.headers["Location"]
            if location.startswith("/"):
                location = self.url + location
            sep = "&" if "?" in location else "?"
            done = requests.put(f"{location}{sep}digest=sha256:{digest}", data=data, timeout=60,
                                headers={"Content-Type": "application/octet-stream"})
            assert done.status_code == 201, done.text
        put = requests.put(f"{self.url}/v2/{repository}/manifests/{tag}", data=manifest, timeout=30,
                           headers={"Content-Type": media_type})
        assert put.status_code == 201, put.text


@pytest.fixture(scope="session")
def registry() -> Iterator[Registry]:
    """A real image registry that the main server trusts (`--registry`)."""
    served = Registry()
    served.start()
    yield served
    served.stop()


@pytest.fixture(scope="session")
def shoal(registry: Registry) -> Iterator[ShoalServer]:
    """The main server: `shoal up` with the state dir and database from the environment,
    pulling template images from the test's registry."""
    database_url = os.environ.get("SHOAL_DATABASE_URL") or sqlite_url(tmp_root() / "shoal.db")
    server = ShoalServer("shoal-main", _state_dir(""), database_url,
                         extra_args=("--registry", registry.url))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shoal_one_slot() -> Iterator[ShoalServer]:
    """A second server whose host holds one sandbox (`--max-sandboxes 1`), with its own
    state dir and SQLite database so that it is a separate fleet of one host."""
    server = ShoalServer(
        "shoal-one-slot", _state_dir("-one-slot"), sqlite_url(tmp_root() / "one-slot.db"),
        extra_args=("--max-sandboxes", "1"),
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def make_account(shoal: ShoalServer) -> Callable[..., Account]:
    """Mint a fresh account and token on the main server: make_account("free")."""
    counter = iter(range(1_000_000))

    def make(tier: str = "team", label: str = "acct") -> Account:
        name = f"sdk-{RUN_ID}-{label}-{next(counter)}"
        return Account(name=name, tier=tier, token=shoal.create_token(name, tier))

    return make


@pytest.fixture(scope="session")
def account(make_account) -> Account:
    """The main test account; `team` so that quotas stay out of the way of other tests."""
    return make_account("team", "main")


@pytest.fixture(scope="session")
def client(shoal: ShoalServer, account: Account) -> Client:
    """An SDK client with the SDK's defaults (30 s timeout, 60 s capacity-retry budget)."""
    return shoal.client(account.token)


@pytest.fixture(scope="session")
def http(shoal: ShoalServer, account: Account) -> requests.Session:
    return shoal.http(account.token)


@pytest.fixture
def sdk_env(shoal: ShoalServer, account: Account, monkeypatch) -> Iterator[None]:
    """Point the SDK's default client at Shoal the way a user does: two env vars."""
    monkeypatch.setenv("PANDASTACK_API", shoal.url)
    monkeypatch.setenv("PANDASTACK_API_KEY", account.token)
    pandastack.set_default_client(None)
    yield
    pandastack.set_default_client(None)


def kill_quietly(sandbox) -> None:
    try:
        sandbox.kill()
    except NotFoundError:
        pass
    except PandastackError as error:
        print(f"cleanup: deleting {sandbox.id} failed: {error}")


class SandboxTracker:
    """Creates sandboxes through the SDK and deletes whatever is left at teardown."""

    def __init__(self, client: Client):
        self.client = client
        self.made: list = []

    def __call__(self, template: str = "base", *, client: Optional[Client] = None, **kwargs):
        sandbox = (client or self.client).sandboxes.create(template=template, **kwargs)
        self.made.append(sandbox)
        return sandbox

    def track(self, *sandboxes):
        self.made.extend(sandboxes)
        return sandboxes[0] if len(sandboxes) == 1 else sandboxes

    def cleanup(self) -> None:
        for sandbox in reversed(self.made):
            kill_quietly(sandbox)
        self.made.clear()


@pytest.fixture
def sandboxes(client: Client) -> Iterator[SandboxTracker]:
    tracker = SandboxTracker(client)
    yield tracker
    tracker.cleanup()


@pytest.fixture(scope="module")
def module_sandboxes(client: Client) -> Iterator[SandboxTracker]:
    tracker = SandboxTracker(client)
    yield tracker
    tracker.cleanup()


def pytest_sessionfinish(session, exitstatus):
    for server in list(_servers):
        server.stop()
    if _tmp_root is None:
        return
    if session.testsfailed or exitstatus not in (0, 5) or os.environ.get("SHOAL_KEEP_TMP") == "1":
        print(f"\nshoal SDK suite: server logs and state kept in {_tmp_root}")
    else:
        shutil.rmtree(_tmp_root, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus == 0 or not _servers:
        return
    for server in _servers:
        terminalreporter.section(f"{server.name} log tail ({server.log_path})")
        terminalreporter.write_line(server.log_tail())


# Cheap, basic checks first; the second server and the quota race last.
MODULE_ORDER = [
    "test_service.py", "test_sandboxes.py", "test_exec.py", "test_files.py", "test_logs_and_ports.py",
    "test_fork.py", "test_lifecycle.py", "test_network.py", "test_repl.py", "test_tenancy.py", "test_usage.py",
    "test_errors.py", "test_quota.py", "test_capacity.py", "test_reaper.py",
]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(MODULE_ORDER)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: keeps order within a module

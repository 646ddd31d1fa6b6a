"""Real processes on loopback for end-to-end tests: start, wait for a condition, clean up.

Every wait is "until the condition holds, up to a deadline" (the machine may be slow); a
process that dies early fails the wait at once with its output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_DEADLINE = float(os.environ.get("LLMGW_TEST_DEADLINE", "30"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llmgw_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LLMGW_SERVER", None)
    env["PYTHONUNBUFFERED"] = "1"
    env["NO_COLOR"] = "1"
    env.update(extra or {})
    return env


LLMGW = [sys.executable, "-m", "llmgw"]


class Proc:
    """A real `llmgw …` process in its own session (so its children die with it); `command` is
    how llmgw is started (the installed console script, for tests of the install itself)."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 preexec_fn: Callable[[], None] | None = None, command: list[str] | None = None) -> None:
        self.name = name
        self.args = args
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [*(command or LLMGW), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=llmgw_env(env),
            start_new_session=True,
            preexec_fn=preexec_fn,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def kill9(self) -> None:
        """kill -9 of the process alone (its children, if any, survive, as on a real node)."""
        if self.alive():
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout: float = 10) -> int | None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.alive():
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(timeout=10)
        self._log.close()
        return self.popen.returncode

    def kill_group(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Waiter:
    """One poll of a `wait_until`: the check, and the failure when time is up or a process died."""

    def __init__(self, what: str, deadline: float, procs: list[Proc] | tuple[Proc, ...]) -> None:
        self.what = what
        self.deadline = deadline
        self.procs = procs
        self.end = time.monotonic() + deadline
        self.last_exc: Exception | None = None

    def value(self, check: Callable[[], T | None]) -> T | None:
        try:
            return check()
        except Exception as exc:  # a server not up yet, a half-written file ...
            self.last_exc = exc
            return None

    def give_up_if_due(self) -> None:
        for p in self.procs:
            if not p.alive():
                raise AssertionError(f"{p.name} exited ({p.popen.returncode}) while waiting for "
                                     f"{self.what}:\n{p.log()[-4000:]}")
        if time.monotonic() > self.end:
            logs = "\n".join(f"--- {p.name}:\n{p.log()[-3000:]}" for p in self.procs)
            raise AssertionError(
                f"timed out after {self.deadline:g}s waiting for {self.what} (last error: {self.last_exc!r})\n{logs}"
            )


def wait_until(
    check: Callable[[], T | None],
    what: str,
    deadline: float = DEFAULT_DEADLINE,
    procs: list[Proc] | tuple[Proc, ...] = (),
    interval: float = 0.05,
) -> T:
    """Poll `check` until it returns a truthy value; fail with `what` and process logs at the deadline."""
    waiter = _Waiter(what, deadline, procs)
    while True:
        value = waiter.value(check)
        if value:
            return value
        waiter.give_up_if_due()
        time.sleep(interval)


def run_llmgw(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
              input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args],
        capture_output=True,
        text=True,
        env=llmgw_env(env),
        timeout=timeout,
        input=input,
    )


def ctl_json(server_url: str, *args: str) -> Any:
    """`llmgw ctl --server URL ARGS -o json`, parsed; raises with stderr on failure."""
    result = run_llmgw("ctl", "--server", server_url, *args, "-o", "json")
    if result.returncode != 0:
        raise RuntimeError(f"ctl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return json.loads(result.stdout)


async def wait_until_async(
    check: Callable[[], T | None],
    what: str,
    deadline: float = DEFAULT_DEADLINE,
    procs: list[Proc] | tuple[Proc, ...] = (),
    interval: float = 0.05,
) -> T:
    """`wait_until` for trio tests: polls without blocking the event loop."""
    import trio

    waiter = _Waiter(what, deadline, procs)
    while True:
        value = await trio.to_thread.run_sync(waiter.value, check)
        if value:
            return value
        waiter.give_up_if_due()
        await trio.sleep(interval)


def bearer(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def writes(token: str | None) -> dict[str, str]:
    """A change's headers: its credential and what no browser sends from another site (as ctl does)."""
    from llmgw.server.forgery import WRITE_HEADERS

    return {**bearer(token), **WRITE_HEADERS}


def token_digest(secret: str) -> str:
    """The `sha256:<hex>` form a config stores for a token or API key (what `ctl hash-secret` prints)."""
    import hashlib

    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


# A fabric service that discovers within a second, for tests that wait on the map.
SIM_FABRIC_FAST = """\
fabric:
  discover_interval: 1s
  sm_interval: 0.5s
  tool_timeout: 5s
"""


def make_sim_fabric(out: Path, node_ids: list[str], *flags: str, rails: int = 2, group_size: int = 2,
                    spines: int = 2) -> dict[str, Any]:
    """`llmgw sim fabric` into `out` (ibnetdiscover and SMIR text for the simulated nodes); its JSON summary."""
    result = run_llmgw("sim", "fabric", "--node-ids", ",".join(node_ids), "--rails", str(rails), "--group-size",
                       str(group_size), "--spines", str(spines), "--out", str(out), "-o", "json", *flags)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def get_json(url: str, timeout: float = 5, verify: Any = True, token: str | None = None) -> Any:
    import httpx

    response = httpx.get(url, timeout=timeout, verify=verify, headers=bearer(token))
    response.raise_for_status()
    return response.json()


class Server:
    """A real `llmgw server` on loopback ports (fixed, so a restart keeps them)."""

    def __init__(self, tmp: Path, config_text: str = "", name: str = "server", extra_args: list[str] | None = None,
                 insecure: bool = True, public_ca: Path | None = None, token: str | None = None,
                 command: list[str] | None = None) -> None:
        self.tmp = tmp
        self.command = command
        self.name = name
        self.public_port = free_port()
        self.fleet_port = free_port()
        self.config = tmp / f"{name}.yaml"
        self.config.write_text(config_text or FAST_FLEET)
        self.extra_args = extra_args or []
        self.insecure = insecure
        # Set when the config has public_tls: the public port speaks TLS, verified against this CA.
        self.public_ca = public_ca
        # Its own state directory (known nodes), kept across restarts of this server only.
        self.state_dir = tmp / f"{name}-state"
        self.proc: Proc | None = None
        # A viewer or operator token for the test's own reads, when the config has credentials.
        self.token = token

    @property
    def url(self) -> str:
        scheme = "https" if self.public_ca else "http"
        return f"{scheme}://127.0.0.1:{self.public_port}"

    @property
    def verify(self) -> Any:
        """httpx's `verify` for the public port."""
        if self.public_ca is None:
            return True
        import ssl

        return ssl.create_default_context(cafile=str(self.public_ca))

    @property
    def fleet_url(self) -> str:
        return f"{'http' if self.insecure else 'https'}://127.0.0.1:{self.fleet_port}"

    def start(self) -> Proc:
        args = ["server", "--config", str(self.config), "--listen", f"127.0.0.1:{self.public_port}",
                "--fleet-listen", f"127.0.0.1:{self.fleet_port}", "--state-dir", str(self.state_dir), *self.extra_args]
        if self.insecure:
            args.append("--insecure")
        self.proc = Proc(self.name, args, self.tmp, command=self.command)
        verify = self.verify
        wait_until(lambda: get_json(f"{self.url}/healthz", verify=verify)["status"] == "ok",
                   f"{self.name} to serve /healthz",
                   procs=[self.proc])
        return self.proc

    def get(self, path: str) -> Any:
        """GET a path of the public port as JSON, with the test's token."""
        return get_json(f"{self.url}{path}", verify=self.verify, token=self.token)

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["id"]: n for n in self.get("/api/v1/nodes")}


FAST_FLEET = """\
fleet:
  heartbeat_interval: 0.25s
  unreachable_after: 3
  lost_after: 2s
  register_timeout: 2s
  max_message: 256KiB
"""


FAST_AGENT = """\
backoff:
  initial: 0.2s
  max: 2s
"""


def make_sim_node(tmp: Path, node_id: str, server_fleet_url: str, extra: str = FAST_AGENT, *args: str) -> Path:
    """`llmgw sim node` into tmp/node_id, with a quick reconnect backoff for tests."""
    node_dir = tmp / node_id
    result = run_llmgw("sim", "node", "--dir", str(node_dir), "--node-id", node_id, "--server", server_fleet_url, *args)
    if result.returncode != 0:
        raise RuntimeError(f"sim node failed: {result.stderr}")
    cfg = node_dir / "agent.yaml"
    cfg.write_text(cfg.read_text() + extra)
    return cfg


def start_agent(tmp: Path, node_id: str, config: Path, *extra: str) -> Proc:
    return Proc(f"agent-{node_id}", ["agent", "--config", str(config), "--insecure", *extra], tmp)


def engines_config(models_yaml: str, extra: str = "", backoff: str = "0.5s", backoff_max: str = "5s") -> str:
    """A server config for engine tests: fast liveness, short settle and backoff."""
    return FAST_FLEET + f"""\
reconcile:
  tick: 0.5s
  settle: 0.5s
  backoff_initial: {backoff}
  backoff_max: {backoff_max}
""" + extra + models_yaml


def replicas(server: Server) -> list[dict[str, Any]]:
    return server.get("/api/v1/replicas")


def engine_key(tmp: Path, shard_id: str) -> str:
    """The engine API key of a shard, read where only the agent's user can: its state file
    (the API never shows it). Tests that talk to an engine directly need it."""
    [state] = list(tmp.glob(f"**/shards/{shard_id}.json"))
    return json.loads(state.read_text())["spec"]["api_key"]


def engine_auth(tmp: Path, shard_id: str) -> dict[str, str]:
    return {"authorization": f"Bearer {engine_key(tmp, shard_id)}"}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def tls_agent_config(base: Path, ca: Path, cert: Path, key: Path, node_id: str | None = None) -> Path:
    """An agent config that dials with the given node certificate (optionally another node id)."""
    text = base.read_text()
    if node_id is not None:
        text = "\n".join(f"node_id: {node_id}" if line.startswith("node_id:") else line
                         for line in text.splitlines()) + "\n"
    out = base.with_name(f"agent-{cert.stem}-{node_id or 'own'}.yaml")
    out.write_text(text + f"tls:\n  ca: {ca}\n  cert: {cert}\n  key: {key}\n")
    return out


def served_serial(port: int, ca: Path) -> int:
    """The serial of the certificate a new TLS handshake with 127.0.0.1:port sees (verified against `ca`)."""
    import ssl

    from cryptography import x509

    context = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def file_serial(cert: Path) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert.read_bytes()).serial_number


def ctl(server_url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`llmgw ctl --server URL ARGS` as a real process (no LLMGW_TOKEN from the test's own environment)."""
    base = {"LLMGW_TOKEN": "", "LLMGW_CA": "", "LLMGW_CERT": "", "LLMGW_KEY": ""}
    return run_llmgw("ctl", "--server", server_url, *args, env={**base, **(env or {})})


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single `llmgw: error: ...` line a failed command printed (and nothing else, no traceback)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmgw: error: "), result.stderr
    return lines[0]


ENGINE_LISTENING = re.compile(r"^llmgw-sim-engine listening on (\S+):(\d+)$", re.M)


def start_sim_engine(tmp: Path, name: str, *args: str) -> tuple[Proc, str]:
    """`llmgw sim engine --port 0 ARGS` on its own (no agent): the process and its URL once /health answers."""
    import httpx

    proc = Proc(name, ["sim", "engine", "--port", "0", "--log-stats-interval", "0", *args], tmp)
    host, port = wait_until(lambda: (m := ENGINE_LISTENING.search(proc.log())) and m.groups(),
                            f"{name} to print its port",
                            procs=[proc])
    url = f"http://{host}:{port}"
    wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, f"{name} /health", procs=[proc])
    return proc, url


class Load:
    """Steady openai-client traffic through the gateway from a few threads, counting what
    failed (a drain or a rollout must lose none). Use as a context manager; `sample` (if given)
    runs between requests of the first thread, so a test can watch a count while the load runs.
    `fresh`: a new connection for every request (the kernel hands each to any gateway worker
    listening), else keep-alive; `retries`: the openai client's max_retries.
    """

    def __init__(self, url: str, model: str, *, threads: int = 3, api_key: str = "none", stream: bool = True,
                 fresh: bool = False, retries: int = 0) -> None:
        import threading

        self.url, self.model, self.threads, self.api_key, self.stream = url, model, threads, api_key, stream
        self.fresh, self.retries = fresh, retries
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers: list[Any] = []

    def _run(self, n: int) -> None:
        import httpx
        import openai

        http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=30) if self.fresh else None
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=self.retries, timeout=30,
                               http_client=http)
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                messages: Any = [{"role": "user", "content": f"load {n}.{i}"}]
                if self.stream:
                    chunks = list(client.chat.completions.create(model=self.model, messages=messages, max_tokens=4,
                                                                 stream=True))
                    assert chunks, "an empty stream"
                else:
                    assert client.chat.completions.create(model=self.model, messages=messages, max_tokens=4).choices
                with self._lock:
                    self.ok += 1
            except Exception as exc:  # every kind of failure counts: a 5xx, a cut stream, a timeout
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Load:
        import threading

        for n in range(self.threads):
            worker = threading.Thread(target=self._run, args=(n,), daemon=True)
            worker.start()
            self._workers.append(worker)
        wait_until(lambda: self.ok >= self.threads or self.failures, "the load's first answers")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=60)

    def wait(self, more: int, what: str) -> None:
        """Until `more` further requests have been answered."""
        target = self.ok + more
        wait_until(lambda: self.ok >= target, what, deadline=60)

"""`llmgw demo`: a whole fleet on loopback, as real processes, with simulated GPUs.

A server, two simulated nodes with eight GPUs each and their agents, and a catalog of two
models served by the simulated engine. One line per step, a ready banner with commands that
work as printed, and on Ctrl-C nothing is left running: agents run with
--stop-engines-on-exit, and whatever is still alive after that is killed by process group.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from llmgw.errors import LlmgwError, UsageError
from llmgw.sim.traffic import advance as advance_traffic

SMALL_MODEL = "llama-3.1-8b-instruct"
LARGE_MODEL = "llama-3.1-70b-instruct"


class DemoOptions(msgspec.Struct, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8080
    fleet_port: int = 8443
    nodes: int = 2
    gpus: int = 8
    dir: str | None = None
    tls: bool = True
    timeout: float = 120.0


def demo_node_ids(opts: DemoOptions) -> list[str]:
    return [f"gpu-{i:02d}" for i in range(1, opts.nodes + 1)]


def check_port_free(host: str, port: int, what: str, flag: str) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UsageError(f"port {port} on {host} ({what}) is in use: {exc.strerror}; "
                             f"pick another with {flag}") from None


def llmgw_command() -> str:
    """How the operator runs llmgw in the printed hints (.venv/bin/llmgw under `make demo`)."""
    exe = Path(sys.executable).parent / "llmgw"
    on_path = shutil.which("llmgw")
    if on_path and Path(on_path).resolve() == exe.resolve():
        return "llmgw"
    if exe.exists():
        try:
            return str(exe.relative_to(Path.cwd()))
        except ValueError:
            return str(exe)
    return f"{sys.executable} -m llmgw"


# The large model's weights come by URL from `llmgw sim fileserver`, slowly enough (a few
# seconds) that `ctl replicas` shows the download line while the demo starts (issue 12).
WEIGHTS_SIZE = 256 * 1000 * 1000
WEIGHTS_RATE = "64MB"
WEIGHTS_LISTENING = "llmgw-sim-fileserver listening on "


def server_config(opts: DemoOptions, work: Path, tls_dir: Path | None, weights_url: str = "", token: str = "") -> str:
    node_ids = demo_node_ids(opts)
    tls = ""
    if tls_dir is not None:
        tls = (
            "tls:\n"
            f"  ca: {tls_dir / 'ca.crt'}\n"
            f"  cert: {tls_dir / 'server.crt'}\n"
            f"  key: {tls_dir / 'server.key'}\n"
            "  require_identity: true\n"
        )
    api = f'api:\n  operator_tokens: ["sha256:{hashlib.sha256(token.encode()).hexdigest()}"]\n' if token else ""
    return f"""\
# Written by `llmgw demo`.
{api}listen: {opts.host}:{opts.port}
fleet_listen: {opts.host}:{opts.fleet_port}
state_dir: {work / 'state'}
{tls}fleet:
  heartbeat_interval: 2s
  lost_after: 1m
fabric:
  # The simulated fabric's map for `ctl fabrics` and /admin/fabrics/ (issue 15), kept fresh.
  discover_interval: 30s
  sm_interval: 15s
reconcile:
  tick: 2s
  # Nothing is placed until the demo's nodes have all registered (issue 18: with a fixed 4 s,
  # gpu-02 came 0.4 s late and both replicas of one model went to gpu-01); at most this long.
  settle: 60s
  expect_nodes: [{", ".join(node_ids)}]
  backoff_initial: 1s
  backoff_max: 30s
remedy:
  # The banner's `llmgw sim node set-gpu … --xid 79` takes that GPU out and moves the replica on
  # it to a healthy GPU, successor ready first (issue 43); cleared, the node returns 30 s later.
  auto_remediate: act
  hold: 2
  clear_after: 30s
models:
  - name: {SMALL_MODEL}
    replicas: 2
    profiles:
      - name: tp1
        engine: sim
        gpus: 1
        args: ["--startup-delay", "1", "--ttft-ms", "40", "--itl-ms", "15"]
        start_timeout: 2m
  - name: {LARGE_MODEL}
    replicas: 1{f"{chr(10)}    source: {weights_url}" if weights_url else ""}
    profiles:
      # One replica on two nodes (4 GPUs on each, over their shared InfiniBand fabric): rank 0
      # serves, rank 1 joins it headless; each gets NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...
      - name: tp4-2nodes
        engine: sim
        nodes: 2
        gpus: 4
        args: ["--startup-delay", "2", "--ttft-ms", "120", "--itl-ms", "30",
               "--fail-if-env-missing", "NCCL_IB_HCA", "--fail-if-env-missing", "NCCL_SOCKET_IFNAME"]
        start_timeout: 2m
"""


class Fleet:
    """The demo's child processes; stopped in reverse order, then killed by group if needed."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the demo only; it stops the rest in order
        )
        log.close()
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-8:]
                raise LlmgwError(f"{name} exited with code {proc.returncode}; its last lines:\n  " + "\n  ".join(tail))

    def stop(self, timeout: float = 20.0) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if proc.poll() is None:
                proc.wait(timeout=5)


def kill_leftover_engines(work: Path, pattern: str = "nodes/*/work/shards/*.json") -> int:
    """Engines are in their own sessions: kill any a crashed agent left (state files say which)."""
    killed = 0
    for state in work.glob(pattern):
        try:
            data = msgspec.json.decode(state.read_bytes())
            pgid = int(data.get("pgid") or data.get("pid") or 0)
        except (OSError, msgspec.DecodeError, ValueError, AttributeError):
            continue
        if pgid > 0:
            try:
                os.killpg(pgid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    return killed


async def _wait_for(check: Callable[[], Any], what: str, fleet: Fleet, within: float) -> Any:
    deadline = trio.current_time() + within
    while True:
        fleet.check_alive()
        try:
            value = await trio.to_thread.run_sync(check)
        except (httpx.HTTPError, ValueError):
            value = None
        if value:
            return value
        if trio.current_time() > deadline:
            raise LlmgwError(f"timed out after {within:g}s waiting for {what}; logs are in {fleet.logs}")
        await trio.sleep(0.25)


DEMO_CERT_DAYS = 365


def _workdir(requested: str | None) -> Path:
    if requested:
        work = Path(requested).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="llmgw-demo-"))
    (work / "logs").mkdir(exist_ok=True)
    (work / "tls").mkdir(exist_ok=True)
    return work


def _remove_all_but_logs(work: Path) -> None:
    for child in work.iterdir():
        if child.name == "logs":
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def _issue_certs(tls_dir: Path, host: str, node_ids: list[str]) -> None:
    from llmgw.tls import ca

    now = time.time()
    # A year: node certificates of 30 days put "expires in 30 days" beside every node at once
    # (ctl nodes notes a certificate under 30 days left), which a demo should not teach.
    ca.init_ca(tls_dir, now=now, name="llmgw demo CA", days=DEMO_CERT_DAYS, force=True)
    ca.issue_server(tls_dir, hosts=["localhost"], ips=[host], now=now, days=DEMO_CERT_DAYS, force=True)
    for node_id in node_ids:
        ca.issue_client(tls_dir, "node", node_id, now=now, days=DEMO_CERT_DAYS, force=True)


async def run_demo(opts: DemoOptions, say: Callable[[str], None]) -> None:
    check_port_free(opts.host, opts.port, "public port", "--port")
    check_port_free(opts.host, opts.fleet_port, "fleet port", "--fleet-port")
    work = await trio.to_thread.run_sync(_workdir, opts.dir)
    logs = work / "logs"
    node_ids = demo_node_ids(opts)
    public = f"http://{opts.host}:{opts.port}"
    say(f"llmgw demo: a server and {opts.nodes} simulated GPU nodes on loopback, in {work}")
    tls_dir: Path | None = None
    if opts.tls:
        tls_dir = work / "tls"
        await trio.to_thread.run_sync(_issue_certs, tls_dir, opts.host, node_ids)
        say(f"  ✓ certificates: a CA, a server certificate for {opts.host} and {len(node_ids)} node certificates "
            f"in {tls_dir}")
    # An operator token, so that every `ctl` call the banner prints (drain, logs, reload) works as
    # printed: the server keeps only its digest; the token is in operator.env for `source`.
    token = secrets.token_urlsafe(24)
    config = work / "server.yaml"
    env_file = work / "operator.env"
    await trio.to_thread.run_sync(_write_private, env_file,
                                  f"export LLMGW_SERVER={public}\nexport LLMGW_TOKEN={token}\n")
    auth = {"authorization": f"Bearer {token}"}
    fleet = Fleet(logs)
    stopped_by_operator = False
    try:
        weights_url = await _start_fileserver(fleet, work, opts.host)
        say(f"  ✓ file server: {weights_url} ({WEIGHTS_SIZE // 10**6} MB at {WEIGHTS_RATE}/s, "
            f"the {LARGE_MODEL} weights)")
        await trio.to_thread.run_sync(config.write_text, server_config(opts, work, tls_dir, weights_url, token))
        server_args = ["server", "--config", str(config)]
        if not opts.tls:
            server_args.append("--insecure")
        fleet.start("server", server_args)
        await _wait_for(lambda: httpx.get(f"{public}/healthz", timeout=2).status_code == 200, "the server", fleet, 30)
        scheme = "https" if opts.tls else "http"
        say(f"  ✓ server: {public} (gateway, API, metrics, admin pages); "
            f"fleet port {scheme}://{opts.host}:{opts.fleet_port}")
        fabric_dir = await _make_fabric(work, node_ids)
        for node_id in node_ids:
            node_dir = work / "nodes" / node_id
            args = ["sim", "node", "--dir", str(node_dir), "--node-id", node_id, "--gpus", str(opts.gpus),
                    "--server", f"{scheme}://{opts.host}:{opts.fleet_port}", "--fabric", str(fabric_dir), "--force",
                    "-o", "json"]
            result = await trio.run_process([sys.executable, "-m", "llmgw", *args], capture_stdout=True,
                                            capture_stderr=True, check=False)
            if result.returncode != 0:
                raise LlmgwError(f"llmgw sim node failed: {result.stderr.decode(errors='replace').strip()}")
            agent_cfg = node_dir / "agent.yaml"
            if tls_dir is not None:
                await trio.to_thread.run_sync(_append, agent_cfg, (
                    f"tls:\n  ca: {tls_dir / 'ca.crt'}\n  cert: {tls_dir / f'node-{node_id}.crt'}\n"
                    f"  key: {tls_dir / f'node-{node_id}.key'}\n"))
            agent_args = ["agent", "--config", str(agent_cfg), "--stop-engines-on-exit"]
            if not opts.tls:
                agent_args.append("--insecure")
            fleet.start(f"agent-{node_id}", agent_args)

        def nodes_ready() -> list[dict[str, Any]] | None:
            nodes = httpx.get(f"{public}/api/v1/nodes", timeout=2, headers=auth).json()
            ready = [n for n in nodes if n["state"] == "ready"]
            return ready if len(ready) == len(node_ids) else None

        for n in await _wait_for(nodes_ready, "the nodes to register", fleet, 60):
            say(f"  ✓ node {n['id']}: {n['gpus']}× {n['gpu_name']} (simulated), {n['ports']} InfiniBand ports, "
                "agent connected")

        fetching: set[str] = set()

        def replicas_ready() -> list[dict[str, Any]] | None:
            replicas = httpx.get(f"{public}/api/v1/replicas", timeout=2, headers=auth).json()
            for r in replicas:
                if r.get("progress") and r["id"] not in fetching:
                    fetching.add(r["id"])
                    say(f"  ↓ {r['model']}: fetching its weights by URL (`ctl replicas` shows the download)")
            ready = [r for r in replicas if r["state"] == "ready"]
            return ready if len(ready) == 3 and len(replicas) == 3 else None

        ready = await _wait_for(replicas_ready, "the replicas to become ready", fleet, opts.timeout)
        fabric_id = await _wait_for_fabric(public, auth, fleet, say)
        summary = ", ".join(
            f"{r['model']} on "
            + " + ".join(f"{sh['node']} GPUs {sh['gpus']}" for sh in sorted(r["shards"], key=lambda sh: sh["rank"]))
            + (f" ({len(r['shards'])}-node replica)" if len(r["shards"]) > 1 else "")
            for r in ready)
        say(f"  ✓ replicas: 3 of 3 ready ({summary})")
        cmd = llmgw_command()
        body = json.dumps({"model": SMALL_MODEL, "messages": [{"role": "user", "content": "Hello!"}]})
        target = await trio.to_thread.run_sync(_curl_target, public, ready)
        say("")
        say(f"Ready. Gateway: {public}/v1")
        # Before any ctl line: every one of them needs it (reads too: the demo has credentials).
        say(f"The fleet's API and pages want this demo's operator token (also in {env_file}):")
        say(f"  export LLMGW_TOKEN={token}")
        say("Try:")
        say(f"  curl -s {target}/v1/chat/completions -H 'content-type: application/json' -d {shlex.quote(body)}")
        say(f"  {cmd} ctl --server {public} nodes")
        say(f"  {cmd} ctl --server {public} replicas --watch")
        say(f"  {cmd} ctl --server {public} models")
        say("Operate it:")
        # The model, not a replica id: it is followed across the drain below (issue 46).
        say(f"  {cmd} ctl --server {public} logs -f {SMALL_MODEL}")
        say(f"  {cmd} ctl --server {public} events --watch")
        say(f"  {cmd} ctl --server {public} doctor")
        small = next(r["id"] for r in ready if r["model"] == SMALL_MODEL)
        shard = next(r for r in ready if r["id"] == small)["shards"][0]
        faulty_dir = shlex.quote(str(work / "nodes" / shard["node"]))
        gpu = shard["gpus"][0]
        say(f"  {cmd} sim node set-gpu {faulty_dir} {gpu} --xid 79   # GPU {gpu} of {shard['node']} falls off the bus: "
            f"{small} moves to a healthy GPU (events --watch says why)")
        say(f"  {cmd} sim node set-gpu {faulty_dir} {gpu} --xid 0    # cleared: {shard['node']} returns 30s later")
        say(f"  {cmd} ctl doctor --list   # every check: what it reads, what its CRIT and WARN mean")
        say(f"  {cmd} sim node set-counter {work / 'nodes' / node_ids[0]} mlx5_0 1 packet_seq_err 900   # then doctor")
        if len(node_ids) >= 2:
            # Every demo node runs a rank of the 2-node replica, which has no other pair to go to.
            last = node_ids[-1]
            say(f"  {cmd} ctl --server {public} drain {last} --force   # the 2-node replica has nowhere else to go: "
                f"down until uncordon")
            say(f"  {cmd} ctl --server {public} uncordon {last}")
        if len(node_ids) >= 2:
            say(f"  {cmd} ctl --server {public} fabric-test {node_ids[0]} {node_ids[1]}")
        say(f"Look at it: {public}/admin/ (sign in with the token above)"
            + (f"; the fabric, live: {public}/admin/fabrics/{fabric_id}" if fabric_id else ""))
        say(f"Logs: {logs}   Ctrl-C stops everything.")
        roots = [work / "nodes" / n / "sys" for n in node_ids]
        traffic_at = time.monotonic()
        while True:
            await trio.sleep(1)
            fleet.check_alive()
            now = time.monotonic()
            # The engines' simulated InfiniBand traffic: the fabric page's particles move.
            await trio.to_thread.run_sync(advance_traffic, roots, now - traffic_at, time.time())
            traffic_at = now
    except trio.Cancelled:
        stopped_by_operator = True  # Ctrl-C or SIGTERM: the demo only ever ends this way when all is well
        raise
    finally:
        with trio.CancelScope(shield=True):
            say("stopping: agents stop their engines, then the server …")
            await trio.to_thread.run_sync(fleet.stop)
            leftovers = await trio.to_thread.run_sync(kill_leftover_engines, work)
            say("stopped; nothing left running"
                + (f" (killed {leftovers} engines a crashed agent left)" if leftovers else ""))
            if not opts.dir:
                if stopped_by_operator:  # the logs the banner pointed at stay; the rest (keys, state) goes
                    await trio.to_thread.run_sync(_remove_all_but_logs, work)
                say(f"logs kept in {logs} (rm -r {work} when done with them)")


async def _make_fabric(work: Path, node_ids: list[str]) -> Path:
    """`llmgw sim fabric` for the demo's nodes: their stand-in ibnetdiscover and saquery print it."""
    out = work / "fabric"
    args = ["sim", "fabric", "--node-ids", ",".join(node_ids), "--rails", "4", "--group-size", str(len(node_ids)),
            "--spines", "2", "--out", str(out), "-o", "json"]
    result = await trio.run_process([sys.executable, "-m", "llmgw", *args], capture_stdout=True, capture_stderr=True,
                                    check=False)
    if result.returncode != 0:
        raise LlmgwError(f"llmgw sim fabric failed: {result.stderr.decode(errors='replace').strip()}")
    return out


async def _wait_for_fabric(public: str, auth: dict[str, str], fleet: Fleet, say: Callable[[str], None]) -> str:
    """The fabric's id once the server has its map (an agent ran ibnetdiscover); "" if it is late."""

    def found() -> dict[str, Any] | None:
        fabrics = httpx.get(f"{public}/api/v1/fabrics", timeout=2, headers=auth).json()
        return next((f for f in fabrics if f.get("topology")), None)

    try:
        fabric = await _wait_for(found, "the fabric map", fleet, 30)
    except LlmgwError:
        say("  … fabric: not mapped yet (`ctl fabrics` shows it once an agent has run ibnetdiscover)")
        return ""
    topo = fabric["topology"]
    say(f"  ✓ fabric {fabric['id']}: {topo['switches']} switches, {topo['adapters']} adapters (simulated InfiniBand, "
        f"mapped by ibnetdiscover on {fabric['discovered_by'].split('/')[0] or 'a node'})")
    return str(fabric["id"])


async def _start_fileserver(fleet: Fleet, work: Path, host: str) -> str:
    """`llmgw sim fileserver` over a sparse weights file; the URL of that file."""
    root = work / "weights" / LARGE_MODEL
    await trio.to_thread.run_sync(_sparse_file, root / "model.safetensors", WEIGHTS_SIZE)
    fleet.start("fileserver", ["sim", "fileserver", "--root", str(root.parent), "--host", host, "--rate", WEIGHTS_RATE])
    log = fleet.logs / "fileserver.log"

    def bound() -> str | None:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(WEIGHTS_LISTENING):
                return line[len(WEIGHTS_LISTENING):].strip()
        return None

    address = await _wait_for(bound, "the file server", fleet, 30)
    return f"http://{address}/{LARGE_MODEL}/model.safetensors"


def _sparse_file(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)


def _curl_target(public: str, ready: list[dict[str, Any]]) -> str:
    """Through the gateway when it answers for the model; else straight at an engine."""
    try:
        models = httpx.get(f"{public}/v1/models", timeout=2)
        if models.status_code == 200 and any(m.get("id") == SMALL_MODEL for m in models.json().get("data", [])):
            return public
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    engine = next(r["endpoint"] for r in ready if r["model"] == SMALL_MODEL)
    return engine

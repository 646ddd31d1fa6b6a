"""One side of `ctl fabric-test`: run `ib_write_bw` through one local port for the server.

The server sends `FabricTest` (role server or client); the agent answers with `FabricTestResult`s
on the same stream:

- server role: pick a free TCP port, start `ib_write_bw -d DEV -i PORT -p TCP ...`, and once the
  process listens on it (seen in /proc/net/tcp and tcp6, not guessed from its banner: perftest
  prints `Waiting for client to connect` before it binds, into a pipe that buffers it) answer
  "ready" with the port; then wait for it to finish and answer "done" with what it printed.
  The port is free when picked (bound to 0, then closed), not reserved: another process may take
  it before perftest binds. So a listener counts only if its socket (the inode in /proc/net/tcp)
  is one of perftest's own open files (/proc/PID/fd of it or its process group): a stranger's
  listener is never reported ready, which would pair the client with the wrong process. And a
  perftest that exits saying `Couldn't listen to port N` (perftest_communication.c,
  ethernet_server_connect: bind failed, exit status 1) is started again on another port, up to
  BIND_TRIES ports in all, each retry said in the result's notes.
- client role: run `ib_write_bw ... SERVER_HOST` against that port and answer "done". The host and
  port are the server's (B's registered address, a port of 1024-65535), never B's own word; a port
  outside that range is refused here too.
- prepare: only make sure ib_write_bw is here (installing perftest if need be), before any rail
  starts, so that one side's install never outlasts the other side's waiting server.

Both sides run with `--report_gbits -F` (-F: a CPU-frequency warning does not fail the run) and the
size the server chose, for `-D SECONDS` (FabricTest.duration, perftest's duration mode: long
enough to mean something; 64 KiB × 5000 iterations is 6.5 ms at 400 Gb/s, less than a link's
credit and congestion loops settle in) or, from an older server, `-n` iterations.

GPUDirect (FabricTest.cuda_device ≥ 0): `--use_cuda=N` puts both sides' buffers in GPU N's memory,
so the HCA reads and writes the GPU over PCIe peer to peer instead of host RAM. That is the path
NCCL takes, and it proves what a host-memory run cannot: that nvidia-peermem (or dma-buf) lets
the HCA register GPU memory, and that the GPU and HCA share a PCIe switch (not the CPU's root
complex, where peer traffic crawls or is blocked by ACS). A node without GPUs refuses it; a
perftest built without CUDA answers ` Unsupported memory type`, said so in the error. On RoCE the
agent passes `-x` with the RoCE v2 GID index that holds the port's IPv4-mapped address (sysfs
gid_attrs/types, read by discovery: the same index launch_env.py gives NCCL as NCCL_IB_GID_INDEX);
without one the run is refused with that reason, since GID 0 (RoCE v1 link-local) does not route. A
run past its timeout, or cancelled, is killed with its process group (fabric_tools.run_tool).

`ib_write_bw` is looked for in `discovery.tools_dir`, then PATH. Missing, and `fabric_test.install`
on, the first test installs perftest with the package manager /etc/os-release names (apt-get on
Debian and Ubuntu, dnf on RHEL, Rocky, Alma, Fedora), found on PATH, and says so in the result's
notes. The agent advertises `fabric-test` only when it has an RDMA port and either ib_write_bw or
a way to install it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence

import msgspec
import trio

from llmgw.agent.fabric_tools import find_tool, run_tool, safe_device
from llmgw.catalog.schema import FabricTestSettings
from llmgw.fabric.railtest import TCP_PORTS
from llmgw.wire import messages as m
from llmgw.wire.ids import printable, quote

log = logging.getLogger("llmgw.agent.fabric_test")

TOOL = "ib_write_bw"
PACKAGE = "perftest"
OUTPUT_CAP = 64 * 1024  # a 23-size `-a` sweep prints 3 kB
READY_TIMEOUT = 15.0  # from start to listening: perftest opens the device first (≈1 s on a real HCA)
MAX_TIMEOUT = 600.0
MAX_QUEUED = 4
BIND_TRIES = 3  # ports tried per server side: a port taken between pick and bind twice running is already rare
BIND_FAILED = b"Couldn't listen to port"  # what perftest prints on stderr when its bind fails
# /etc/os-release ID / ID_LIKE words → the package manager and its install command.
INSTALLERS = {
    "debian": ("apt-get", ["install", "-y", "--no-install-recommends", PACKAGE]),
    "ubuntu": ("apt-get", ["install", "-y", "--no-install-recommends", PACKAGE]),
    "rhel": ("dnf", ["install", "-y", PACKAGE]),
    "fedora": ("dnf", ["install", "-y", PACKAGE]),
    "centos": ("dnf", ["install", "-y", PACKAGE]),
    "rocky": ("dnf", ["install", "-y", PACKAGE]),
    "almalinux": ("dnf", ["install", "-y", PACKAGE]),
}
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def os_family(os_release: str) -> list[str]:
    """The ID and ID_LIKE words of an os-release text, most specific first."""
    values: dict[str, str] = {}
    for line in os_release.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip().strip('"').strip("'").lower()
    return [w for w in [values.get("ID", ""), *values.get("ID_LIKE", "").split()] if w]


def install_command(os_release: str, which: Callable[[str], str | None]) -> list[str] | None:
    """The argv that installs perftest here, or None (an OS we do not know, or no such tool on PATH)."""
    for word in os_family(os_release):
        if word in INSTALLERS:
            tool, args = INSTALLERS[word]
            path = which(tool)
            return [path, *args] if path else None
    return None


def listening_inodes(proc_net_tcp: str, port: int) -> set[int]:
    """The inodes of the sockets listening on `port` in a /proc/net/tcp (or tcp6) text."""
    want = f":{port:04X}"
    out = set()
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[1].endswith(want) and fields[3] == _LISTEN and fields[9].isdigit():
            out.add(int(fields[9]))
    return out


def listening(proc_net_tcp: str, port: int) -> bool:
    """Whether a /proc/net/tcp (or tcp6) text has a socket listening on `port`."""
    return bool(listening_inodes(proc_net_tcp, port))


def socket_inodes(pid: int, proc: str = "/proc") -> set[int]:
    """The inodes of the sockets a process holds open (its fd links read `socket:[INODE]`)."""
    fd_dir = os.path.join(proc, str(pid), "fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return set()
    out = set()
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]") and target[8:-1].isdigit():
            out.add(int(target[8:-1]))
    return out


def group_pids(pgid: int, proc: str = "/proc") -> list[int]:
    """The processes of a process group (the children of a wrapper script are in its group)."""
    out: list[int] = []
    try:
        entries = os.listdir(proc)
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _read(os.path.join(proc, entry, "stat")).rpartition(")")[2].split()
        if len(fields) > 2 and fields[2] == str(pgid):  # state, ppid, pgrp
            out.append(int(entry))
    return out


def ours_listening(port: int, pid: int, proc: str = "/proc") -> tuple[bool, bool]:
    """(ours, anyone): whether a socket listening on `port` is held by process `pid` (or another
    process of its group), and whether anything listens there at all."""
    inodes = listening_inodes(_read(os.path.join(proc, "net", "tcp")), port)
    inodes |= listening_inodes(_read(os.path.join(proc, "net", "tcp6")), port)
    if not inodes:
        return False, False
    if inodes & socket_inodes(pid, proc):
        return True, True
    return any(inodes & socket_inodes(other, proc) for other in group_pids(pid, proc) if other != pid), True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


class FabricTester:
    """Answers FabricTest and FabricTestCancel; one run at a time (two would share a link)."""

    def __init__(self, settings: FabricTestSettings, tools_dir: str = "", *,
                 ports: Callable[[], Sequence[m.Port]] = list, pick_port: Callable[[], int] = free_port,
                 gpus: Callable[[], Sequence[m.Gpu]] = list) -> None:
        self.settings = settings
        self.gpus = gpus  # the node's GPUs as last discovered: GPUDirect runs need one
        self.pick_port = pick_port  # the server side's TCP port (free when picked, not reserved)
        self.tools_dir = tools_dir
        self.ports = ports  # the node's RDMA ports as last discovered (GID tables, link layer)
        self.path = find_tool(TOOL, tools_dir)
        self.installer: list[str] | None = None
        if self.path is None and settings.install:
            self.installer = install_command(_read(settings.os_release), lambda name: find_tool(name))
        self._running: dict[str, trio.CancelScope] = {}
        self._queue_send, self._queue_receive = trio.open_memory_channel[m.FabricTest](MAX_QUEUED)
        if self.path is None:
            if self.installer:
                log.info("%s not found (discovery.tools_dir %r, then PATH): the first fabric test installs %s with %s",
                         TOOL, tools_dir, PACKAGE, os.path.basename(self.installer[0]))
            else:
                log.info("%s not found (discovery.tools_dir %r, then PATH) and no way to install %s here "
                         "(fabric_test.install, apt-get or dnf): this node cannot run fabric tests",
                         TOOL, tools_dir, PACKAGE)

    @property
    def features(self) -> list[str]:
        if not (self.path or self.installer):
            return []
        out = [m.FEATURE_FABRIC_TEST, m.FEATURE_FABRIC_TEST_DURATION]
        return out + ([m.FEATURE_FABRIC_TEST_GPUDIRECT] if self.gpus() else [])

    def accept(self, msg: m.FabricTest | m.FabricTestCancel, send: Callable[[msgspec.Struct], None]) -> None:
        """From the stream's reader: queue a run (answered at once when busy) or cancel one."""
        if isinstance(msg, m.FabricTestCancel):
            scope = self._running.get(msg.request_id)
            if scope is not None:
                scope.cancel()
            return
        try:
            self._queue_send.send_nowait(msg)
        except trio.WouldBlock:
            send(m.FabricTestResult(request_id=msg.request_id, error=f"busy: {MAX_QUEUED} fabric tests already queued"))

    async def serve(self, send: Callable[[msgspec.Struct], None]) -> None:
        """Run the queued tests, one at a time, for one stream's life (a new stream starts empty:
        what an earlier one queued has no one waiting for it)."""
        while True:
            try:
                self._queue_receive.receive_nowait()
            except trio.WouldBlock:
                break
        async for req in self._queue_receive:
            scope = trio.CancelScope()
            self._running[req.request_id] = scope
            try:
                await self.run(req, send, scope)
            finally:
                self._running.pop(req.request_id, None)

    async def run(self, req: m.FabricTest, send: Callable[[msgspec.Struct], None],
                  scope: trio.CancelScope | None = None) -> None:
        scope = scope or trio.CancelScope()
        done = m.FabricTestResult(request_id=req.request_id)
        started = time.monotonic()
        try:
            with scope:
                await self._run(req, send, done)
            if scope.cancelled_caught and not done.error:
                done.error = f"{TOOL} stopped: the server cancelled it (its partner failed, or the test was stopped)"
        except OSError as exc:
            done.error = f"cannot run {TOOL}: {exc.strerror or exc}"
        done.duration = round(time.monotonic() - started, 3)
        done.ok = not done.error
        if req.role != "prepare" or done.error:
            log.log(logging.INFO if done.ok else logging.WARNING, "fabric test %s (%s side, %s/%d): %s",
                    quote(req.request_id[:40]), quote(req.role[:16]), quote(req.device[:64]), req.port,
                    "done" if done.ok else printable(done.error))
        send(done)

    async def _run(self, req: m.FabricTest, send: Callable[[msgspec.Struct], None], done: m.FabricTestResult) -> None:
        problem = self._check(req)
        if problem:
            done.error = problem
            return
        if self.path is None and not await self._install(req, send, done):
            return
        assert self.path is not None
        if req.role == "prepare":
            return  # ib_write_bw is here (installed now if it was not): the server may pair the sides
        gid = self._gid_index(req, done)
        if done.error:
            return
        done.gid_index = gid
        timeout = min(max(req.timeout, 1.0), MAX_TIMEOUT)
        if req.role == "client":
            argv = [*self._argv(req, req.server_port, gid), req.server_host]
            out, err, code, timed_out, _ = await run_tool(argv, timeout)
            self._finish(done, out, err, code, timed_out, timeout)
            return
        taken: list[int] = []
        for _ in range(BIND_TRIES):
            tcp_port = self.pick_port()
            ran, ready = await self._serve(req, send, done, tcp_port, gid, timeout)
            if ran is None:
                return  # not listening in time (done.error says so), or cancelled
            out, err, code, timed_out, _ = ran
            if ready or timed_out or code == 0 or BIND_FAILED not in err:
                done.error = ""
                self._finish(done, out, err, code, timed_out, timeout)
                return
            taken.append(tcp_port)
            done.notes.append(f"TCP port {tcp_port} was taken before {TOOL} could listen on it"
                              + ("; trying another" if len(taken) < BIND_TRIES else ""))
            log.info("fabric test %s: %s", quote(req.request_id[:40]), done.notes[-1])
        done.error = (f"{TOOL} could not listen on any of {BIND_TRIES} free TCP ports "
                      f"({', '.join(map(str, taken))}): each was taken before it bound")

    async def _serve(self, req: m.FabricTest, send: Callable[[msgspec.Struct], None], done: m.FabricTestResult,
                     tcp_port: int, gid: int,
                     limit: float) -> tuple[tuple[bytes, bytes, int | None, bool, bool] | None, bool]:
        """One server-side run on `tcp_port`: (what run_tool returned, or None if it was killed
        before it listened; whether "ready" was sent)."""
        argv = self._argv(req, tcp_port, gid)
        box: list[tuple[bytes, bytes, int | None, bool, bool]] = []
        pid: list[int] = []
        ready = False
        foreign = False
        async with trio.open_nursery() as nursery:
            async def perftest() -> None:
                box.append(await run_tool(argv, limit, started=pid.append))
                nursery.cancel_scope.cancel()  # it ended (before listening: the caller reads why)

            nursery.start_soon(perftest)
            with trio.move_on_after(READY_TIMEOUT) as waiting:
                # The kernel's socket table has no event to wait on: look every 50 ms.
                while True:
                    if pid:
                        ours, foreign = await trio.to_thread.run_sync(ours_listening, tcp_port, pid[0])
                        if ours:
                            break
                    await trio.sleep(0.05)
            if waiting.cancelled_caught:
                done.error = (f"{TOOL} did not listen on TCP port {tcp_port} within {READY_TIMEOUT:g}s"
                              + (" (another process listens there)" if foreign else "") + "; killed")
                nursery.cancel_scope.cancel()
            else:
                # Listening: the client may come; perftest ends the nursery when it finishes (or its timeout).
                ready = True
                send(m.FabricTestResult(request_id=req.request_id, phase="ready", ok=True, tcp_port=tcp_port,
                                        gid_index=gid, notes=list(done.notes)))
        return (box[0] if box else None), ready

    def _check(self, req: m.FabricTest) -> str:
        if req.role not in m.FABRIC_TEST_ROLES:
            return f"unknown role {req.role!r} ({', '.join(m.FABRIC_TEST_ROLES)})"
        if req.role == "prepare":
            return ""
        if not safe_device(req.device):
            return f"device {req.device!r} is not an RDMA device name"
        if req.role == "client" and (not req.server_host or not 0 < req.server_port < 65536):
            return "a client run needs the server side's host and TCP port"
        if req.role == "client" and (req.server_host.startswith("-") or any(c.isspace() for c in req.server_host)):
            return f"server host {req.server_host!r} is not a host name or address"
        # the server checks it too (railtest.client_target)
        if req.role == "client" and req.server_port not in TCP_PORTS:
            return f"server port {req.server_port} is outside {TCP_PORTS.start}-{TCP_PORTS.stop - 1}: not dialled"
        if not 1 <= req.size <= 1 << 30 or not 1 <= req.iterations <= 10_000_000:
            return "size and iterations out of range"
        if not 0 <= req.duration <= MAX_TIMEOUT or (req.duration and req.duration >= req.timeout):
            return f"a {req.duration} s run does not fit in its {req.timeout:g} s timeout"
        if req.cuda_device >= 0 and not any(g.index == req.cuda_device for g in self.gpus()):
            have = ", ".join(str(g.index) for g in self.gpus())
            return (f"GPUDirect asked for GPU {req.cuda_device}, and this node has "
                    + (f"GPUs {have} only" if have else "no GPU") + ": nothing to run --use_cuda on")
        return ""

    def _gid_index(self, req: m.FabricTest, done: m.FabricTestResult) -> int:
        port = next((p for p in self.ports() if p.device == req.device and p.port == req.port), None)
        if port is None:
            done.error = f"this node has no RDMA port {req.device}/{req.port}"
            return -1
        if port.link_layer != "Ethernet":
            return -1
        if port.roce_v2_ipv4_gid_index < 0:
            done.error = (f"{req.device}/{req.port} is RoCE but has no RoCE v2 GID with an IPv4 address (no IPv4 "
                          "address on its interface?); GID 0 would not route")
            return -1
        done.notes.append(f"{req.device}/{req.port}: RoCE v2 GID index {port.roce_v2_ipv4_gid_index}")
        return port.roce_v2_ipv4_gid_index

    def _argv(self, req: m.FabricTest, tcp_port: int, gid: int) -> list[str]:
        assert self.path is not None
        argv = [self.path, "-d", req.device, "-i", str(req.port), "-p", str(tcp_port), "-s", str(req.size),
                *(["-D", str(req.duration)] if req.duration > 0 else ["-n", str(req.iterations)]),
                "-F", "--report_gbits"]
        argv += [f"--use_cuda={req.cuda_device}"] if req.cuda_device >= 0 else []
        return argv + (["-x", str(gid)] if gid >= 0 else [])

    def _finish(self, done: m.FabricTestResult, out: bytes, err: bytes, code: int | None, timed_out: bool,
                timeout: float) -> None:
        tail = err.decode("utf-8", "replace").strip()[-500:]
        done.exit_code = code
        done.output = (out.decode("utf-8", "replace") + ("\n" + tail if tail else ""))[-OUTPUT_CAP:]
        if timed_out:
            done.error = f"{TOOL} did not finish within {timeout:g}s; killed"
        elif code != 0:
            done.error = f"{TOOL} exited with status {code}" + (f": {tail.splitlines()[-1]}" if tail else "")
            if b"Unsupported memory type" in out + err:  # perftest_parameters.c: built without CUDA
                done.error += (f" ({TOOL} here was built without CUDA, as distribution perftest packages are: "
                               "GPUDirect needs perftest built with CUDA_H_PATH)")

    async def _install(self, req: m.FabricTest, send: Callable[[msgspec.Struct], None],
                       done: m.FabricTestResult) -> bool:
        if not self.installer:
            done.error = f"{TOOL} is not installed on this node (install {PACKAGE}, or set fabric_test.install)"
            return False
        manager = os.path.basename(self.installer[0])
        note = f"{TOOL} missing: installing {PACKAGE} with {manager}"
        log.warning("%s", note)
        send(m.FabricTestResult(request_id=req.request_id, phase="progress", ok=True, notes=[note]))
        started = time.monotonic()
        out, err, code, timed_out, _ = await run_tool(self.installer, float(self.settings.install_timeout))
        self.path = find_tool(TOOL, self.tools_dir)
        took = time.monotonic() - started
        if self.path is None:
            tail = (err or out).decode("utf-8", "replace").strip().splitlines()
            why = ("timed out" if timed_out else f"exit status {code}") + (f": {tail[-1][:300]}" if tail else "")
            done.error = f"installing {PACKAGE} with {manager} did not give {TOOL} ({why})"
            log.error("%s", done.error)
            return False
        done.notes.append(f"installed {PACKAGE} with {manager} ({took:.0f} s)")
        log.info("installed %s with %s in %.0f s: %s", PACKAGE, manager, took, self.path)
        return True

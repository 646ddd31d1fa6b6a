"""The fabric tools an agent runs for the server: `ibnetdiscover` and `saquery SMIR`.

The server sends one `Discover`; the agent runs the tool through the named local port, reads at
most TEXT_CAP bytes of what it prints, and answers with one `DiscoverResult` on the same stream:
the raw text (zlib-compressed above COMPRESS_ABOVE), never parsed here, so a format the parser
has not met is fixed by upgrading the server, not every node. A tool that outlives its timeout is
killed with its whole process group. Requests run one at a time (an ibnetdiscover sweep of a
large fabric sends thousands of MADs; two at once only slow each other); a queue of MAX_QUEUED
bounds what waits, and a request past it is answered "busy" at once.

What one result may carry follows the server: its Welcome names the largest message it reads
(fleet.max_message), and output whose compressed form would not fit in one is answered with an
error saying so, instead of a message that would end the stream at the server (`fit`).

An agent advertises `discover` only when it finds both tools (in `discovery.tools_dir`, then on
PATH); without them it says which is missing, once, and the server never asks it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
import zlib
from collections.abc import Callable

import msgspec
import trio

from llmgw.wire import messages as m

log = logging.getLogger("llmgw.agent.fabric")

TEXT_CAP = 64 * 1024 * 1024  # raw output read at most: a 4,000-node, 8-rail fabric prints 12 MB
COMPRESS_ABOVE = 64 * 1024
DATA_CAP = 2_500_000  # compressed bytes sent at most: base64 makes it 3.3 MB, under the 4 MiB message limit
ENVELOPE_ROOM = 8192  # a DiscoverResult's fields besides its data (the error's stderr tail, JSON-escaped)
STDERR_TAIL = 2048
MAX_QUEUED = 4
MAX_TIMEOUT = 600.0
COMMANDS = {m.TOOL_IBNETDISCOVER: "ibnetdiscover", m.TOOL_SMIR: "saquery"}


def find_tool(name: str, tools_dir: str = "") -> str | None:
    if tools_dir:
        path = os.path.join(tools_dir, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which(name)


class FabricTools:
    def __init__(self, tools_dir: str = "", *, data_cap: int = DATA_CAP) -> None:
        self.paths = {tool: find_tool(command, tools_dir) for tool, command in COMMANDS.items()}
        self.configured_cap = data_cap
        self.data_cap = data_cap
        self.cap_note = ""  # where a cap below the configured one came from, for the error text
        missing = [COMMANDS[t] for t, p in self.paths.items() if p is None]
        if missing:
            log.info("%s not found (discovery.tools_dir %r, then PATH): this node cannot map the fabric "
                     "for the server; install infiniband-diags to let it", " and ".join(missing), tools_dir)

    def fit(self, server_max: int, own_max: int = 0) -> None:
        """Cap the data to what one message carries: `server_max` is the limit the server's Welcome
        gave (its fleet.max_message; 0: not said), `own_max` this end's. The data travels as
        base64 in JSON (4 bytes for every 3) beside the result's other fields."""
        limits = [(server_max, "the server's fleet.max_message"), (own_max, "this agent's message limit")]
        known = [(size, what) for size, what in limits if size > 0]
        self.data_cap, self.cap_note = self.configured_cap, ""
        if known:
            size, what = min(known)
            cap = max(0, (size - ENVELOPE_ROOM) * 3 // 4)
            if cap < self.configured_cap:
                self.data_cap, self.cap_note = cap, f"{what} is {size:,} bytes"

    @property
    def features(self) -> list[str]:
        return [m.FEATURE_DISCOVER] if all(self.paths.values()) else []

    def argv(self, req: m.Discover) -> list[str] | None:
        path = self.paths.get(req.tool)
        if path is None:
            return None
        where = ["-C", req.device, "-P", str(req.port)] if req.device else []
        return [path, *where, "SMIR"] if req.tool == m.TOOL_SMIR else [path, *where]

    async def serve(self, requests: trio.MemoryReceiveChannel[m.Discover],
                    send: Callable[[msgspec.Struct], None]) -> None:
        async for req in requests:
            send(await self.run(req))

    async def run(self, req: m.Discover) -> m.DiscoverResult:
        result = m.DiscoverResult(request_id=req.request_id, tool=req.tool, device=req.device, port=req.port)
        if req.tool not in COMMANDS:
            result.error = f"unknown tool {req.tool!r} (this agent runs {', '.join(COMMANDS)})"
            return result
        argv = self.argv(req)
        if argv is None:
            result.error = f"{COMMANDS[req.tool]} is not installed on this node"
            return result
        if req.device and not _safe_device(req.device):
            result.error = f"device {req.device!r} is not an RDMA device name"
            return result
        timeout = min(max(req.timeout, 0.1), MAX_TIMEOUT)
        started = time.monotonic()
        try:
            text, stderr, code, timed_out, truncated = await _run(argv, timeout)
        except OSError as exc:
            result.error = f"cannot run {argv[0]}: {exc.strerror or exc}"
            return result
        result.duration = round(time.monotonic() - started, 3)
        result.exit_code = code
        result.size = len(text)
        result.truncated = truncated
        tail = stderr.decode("utf-8", "replace").strip()[-500:]
        if timed_out:
            result.error = f"{COMMANDS[req.tool]} did not finish within {timeout:g}s; killed"
        elif code != 0:
            result.error = f"{COMMANDS[req.tool]} exited with status {code}" + (f": {tail}" if tail else "")
        if len(text) > COMPRESS_ABOVE:
            data = await trio.to_thread.run_sync(zlib.compress, text, 6)
            result.encoding = "zlib"
        else:
            data = text
        if len(data) > self.data_cap:
            result.truncated = True
            why = f": {self.cap_note}" if self.cap_note else ""
            result.error = result.error or (f"{COMMANDS[req.tool]} printed {len(text):,} bytes "
                                            f"({len(data):,} compressed); "
                                            f"more than one message to the server carries ({self.data_cap:,}{why})")
            data = b""
        result.data = data
        result.ok = not result.error and not result.truncated
        return result


def _safe_device(name: str) -> bool:
    return 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "_-.") for c in name)


async def _run(argv: list[str], limit: float,
               started: Callable[[int], None] | None = None) -> tuple[bytes, bytes, int | None, bool, bool]:
    """Run argv in its own process group; (stdout up to TEXT_CAP, stderr's tail, exit status,
    timed out, truncated). A process still running at the deadline, or printing past the cap, is
    killed with its group (a shell script's children included). `started` gets its pid (= its
    process group's id) as soon as it runs."""
    proc = await trio.lowlevel.open_process(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, start_new_session=True)
    if started is not None:
        started(proc.pid)
    out = bytearray()
    err = bytearray()
    truncated = False
    timed_out = True

    async def read_out() -> None:
        nonlocal truncated
        assert proc.stdout is not None
        while True:
            chunk = await proc.stdout.receive_some(65536)
            if not chunk:
                return
            out.extend(chunk[: TEXT_CAP - len(out)])
            if len(out) >= TEXT_CAP:
                truncated = True
                _kill_group(proc)
                return

    async def read_err() -> None:
        assert proc.stderr is not None
        while True:
            chunk = await proc.stderr.receive_some(16384)
            if not chunk:
                return
            err.extend(chunk)
            del err[:-STDERR_TAIL]

    try:
        with trio.move_on_after(limit):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_out)
                nursery.start_soon(read_err)
            await proc.wait()
            timed_out = False
    finally:
        if proc.returncode is None:
            _kill_group(proc)
            with trio.CancelScope(shield=True):
                await proc.wait()
    return bytes(out), bytes(err), proc.returncode, timed_out, truncated


def _kill_group(proc: trio.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


# For the other tools an agent runs for the server (agent/fabric_test.py: ib_write_bw).
run_tool = _run
safe_device = _safe_device

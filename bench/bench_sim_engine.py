"""Throughput and CPU cost of `llmgw sim engine --fixed`, against a bare trio baseline.

The fixed-response engine is the upstream of the gateway benchmark (2,500 requests/s through
the gateway on a 2-core machine), so it must answer far faster than that alone and cost little
CPU per request. This starts the engine as a real process, drives it over keep-alive HTTP/1.1
connections from a raw-socket load generator in another process, and reads both processes'
CPU time from /proc. The baseline is a trio server in this file that does the least an HTTP
server can (find the end of the head, skip Content-Length bytes, write canned bytes): the
ratio engine/baseline is the cost of real parsing, routing and JSON.

    .venv/bin/python bench/bench_sim_engine.py [--seconds 3] [--connections 32]

If `wrk` is on PATH it is run too (same engine, its own numbers); without it that part is
skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchutil import cpu_seconds

GATEWAY_BAR_RPS = 2500

CHAT = json.dumps(
    {
        "model": "llmgw/sim-model",
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 16,
    }
)
CHAT_STREAM = json.dumps(
    {
        "model": "llmgw/sim-model",
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
)


def request_bytes(path: str, body: str) -> bytes:
    raw = body.encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode() + raw


# ---- load generator (runs in its own process) ----------------------------------------------


def _response_end(buf: bytes | bytearray) -> int:
    """Index just past one complete response in buf, or -1."""
    head_end = buf.find(b"\r\n\r\n")
    if head_end < 0:
        return -1
    head = bytes(buf[:head_end]).lower()
    m = re.search(rb"content-length: *(\d+)", head)
    if m:
        end = head_end + 4 + int(m.group(1))
        return end if len(buf) >= end else -1
    if b"transfer-encoding: chunked" in head:
        term = buf.find(b"\r\n0\r\n\r\n", head_end)
        return -1 if term < 0 else term + 7
    return -1


def run_client(port: int, payload: bytes, connections: int, seconds: float) -> dict[str, float]:
    sel = selectors.DefaultSelector()
    bufs: dict[socket.socket, bytearray] = {}
    for _ in range(connections):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        bufs[s] = bytearray()
        sel.register(s, selectors.EVENT_READ)
        s.sendall(payload)
    done = 0
    errors = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for key, _ in sel.select(timeout=0.5):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            data = s.recv(262144)
            if not data:
                raise SystemExit("the server closed a keep-alive connection")
            buf = bufs[s]
            buf += data
            while True:
                end = _response_end(buf)
                if end < 0:
                    break
                if not buf.startswith(b"HTTP/1.1 200"):
                    errors += 1
                del buf[:end]
                done += 1
                s.sendall(payload)
    elapsed = time.perf_counter() - start
    usage = os.times()
    return {
        "requests": done,
        "errors": errors,
        "seconds": elapsed,
        "cpu": usage.user + usage.system,
    }


# ---- servers under test --------------------------------------------------------------------


def start_engine(extra: list[str]) -> tuple[subprocess.Popen[str], int]:
    cmd = [
        sys.executable,
        "-m",
        "llmgw",
        "sim",
        "engine",
        "--port",
        "0",
        "--log-stats-interval",
        "0",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.match(r"llmgw-sim-engine listening on \S+:(\d+)", line)
        if m:
            port = int(m.group(1))
            _wait_ready(port)
            return proc, port
    proc.kill()
    raise SystemExit("the engine did not print its listening line")


def _wait_ready(port: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                if s.recv(100).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit("the engine never became healthy")


BASELINE = r"""
import sys, trio
BODY = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hello"}}]}'
RESP = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY
async def conn(stream):
    try:
        await serve(stream)
    except trio.BrokenResourceError:
        pass
async def serve(stream):
    buf = bytearray()
    while True:
        while True:
            i = buf.find(b"\r\n\r\n")
            if i >= 0:
                j = buf.find(b"content-length:", 0, i)
                if j < 0:
                    j = buf.find(b"Content-Length:", 0, i)
                n = int(buf[j + 15:buf.find(b"\r\n", j)]) if j >= 0 else 0
                if len(buf) >= i + 4 + n:
                    del buf[:i + 4 + n]
                    break
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
        await stream.send_all(RESP)
async def main():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print("llmgw-sim-engine listening on 127.0.0.1:%d" % listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(conn, listeners)
trio.run(main)
"""


H11_REFERENCE = r"""
import h11, trio
BODY = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hello"}}]}'
async def conn(stream):
    c = h11.Connection(h11.SERVER)
    try:
        while True:
            while True:
                ev = c.next_event()
                if ev is h11.NEED_DATA:
                    c.receive_data(await stream.receive_some(65536))
                    continue
                if isinstance(ev, h11.ConnectionClosed):
                    return
                if isinstance(ev, h11.EndOfMessage):
                    break
            out = c.send(h11.Response(status_code=200, headers=[("content-type", "application/json"),
                                                                ("content-length", str(len(BODY)))]))
            out += c.send(h11.Data(data=BODY)) + c.send(h11.EndOfMessage())
            await stream.send_all(out)
            c.start_next_cycle()
    except (trio.BrokenResourceError, h11.RemoteProtocolError):
        pass
async def main():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print("llmgw-sim-engine listening on 127.0.0.1:%d" % listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(conn, listeners)
trio.run(main)
"""


def start_baseline(script: str = BASELINE) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.match(r"llmgw-sim-engine listening on \S+:(\d+)", line)
    if not m:
        proc.kill()
        raise SystemExit("baseline server did not start")
    return proc, int(m.group(1))


def measure(
    proc: subprocess.Popen[str], port: int, payload: bytes, connections: int, seconds: float
) -> dict[str, float]:
    cpu0 = cpu_seconds(proc.pid)
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        code = (
            "import json,sys; sys.path.insert(0, sys.argv[1]); import bench_sim_engine as b; "
            "r = b.run_client(int(sys.argv[2]), bytes.fromhex(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])); "
            "open(sys.argv[6], 'w').write(json.dumps(r))"
        )
        subprocess.run(
            [
                sys.executable,
                "-c",
                code,
                str(Path(__file__).parent),
                str(port),
                payload.hex(),
                str(connections),
                str(seconds),
                out.name,
            ],
            check=True,
        )
        result = json.loads(Path(out.name).read_text())
    server_cpu = cpu_seconds(proc.pid) - cpu0
    n = max(result["requests"], 1)
    return {
        "rps": result["requests"] / result["seconds"],
        "server_us_per_req": server_cpu / n * 1e6,
        "server_cpu_pct": server_cpu / result["seconds"] * 100,
        "client_us_per_req": result["cpu"] / n * 1e6,
        "errors": result["errors"],
        "requests": result["requests"],
    }


def run_wrk(port: int, seconds: float, connections: int) -> str:
    wrk = shutil.which("wrk")
    if wrk is None:
        return "wrk: not installed, skipped (apt-get install -y wrk to add it)"
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(
            f'wrk.method = "POST"\nwrk.body = {json.dumps(CHAT)}\nwrk.headers["Content-Type"] = "application/json"\n'
        )
    try:
        out = subprocess.run(
            [
                wrk,
                "-t1",
                f"-c{connections}",
                f"-d{max(int(seconds), 1)}s",
                "-s",
                script.name,
                f"http://127.0.0.1:{port}/v1/chat/completions",
            ],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    finally:
        os.unlink(script.name)
    m = re.search(r"Requests/sec:\s*([\d.]+)", out)
    return (
        f"wrk: {float(m.group(1)):,.0f} requests/s (1 thread, {connections} connections)"
        if m
        else "wrk: " + out
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args()

    print(
        f"machine: {os.cpu_count()} CPUs; {args.connections} keep-alive connections; {args.seconds:.0f} s per run"
    )
    rows = []
    proc, port = start_baseline()
    try:
        base = measure(
            proc, port, request_bytes("/v1/chat/completions", CHAT), args.connections, args.seconds
        )
    finally:
        proc.terminate()
        proc.wait()
    rows.append(("baseline (bare trio, canned bytes)", base))

    # The same canned answer through h11: what parsing with h11 alone costs (see llmgw/web/http1.py).
    proc, port = start_baseline(H11_REFERENCE)
    try:
        rows.append(
            (
                "h11 reference (canned answer)",
                measure(
                    proc,
                    port,
                    request_bytes("/v1/chat/completions", CHAT),
                    args.connections,
                    args.seconds,
                ),
            )
        )
    finally:
        proc.terminate()
        proc.wait()

    proc, port = start_engine(["--fixed", "--fixed-chunks", "4"])
    try:
        rows.append(
            (
                "engine --fixed chat",
                measure(
                    proc,
                    port,
                    request_bytes("/v1/chat/completions", CHAT),
                    args.connections,
                    args.seconds,
                ),
            )
        )
        rows.append(
            (
                "engine --fixed chat stream (4 chunks)",
                measure(
                    proc,
                    port,
                    request_bytes("/v1/chat/completions", CHAT_STREAM),
                    args.connections,
                    args.seconds,
                ),
            )
        )
        wrk_line = run_wrk(port, args.seconds, args.connections)
    finally:
        proc.terminate()
        proc.wait(timeout=10)

    print(
        f"{'server':40} {'req/s':>9} {'srv µs/req':>11} {'srv CPU':>8} {'client µs/req':>14}"
        f" {'req/s ratio':>12} {'µs/req ratio':>13}"
    )
    for name, r in rows:
        print(
            f"{name:40} {r['rps']:9,.0f} {r['server_us_per_req']:11.1f} {r['server_cpu_pct']:7.0f}% "
            f"{r['client_us_per_req']:14.1f} {r['rps'] / base['rps']:11.2f}x"
            f" {r['server_us_per_req'] / base['server_us_per_req']:12.2f}x"
            + (f"  ({r['errors']} non-200)" if r["errors"] else "")
        )
    for name, r in rows[1:]:
        share = GATEWAY_BAR_RPS * r["server_us_per_req"] / 1e6 * 100
        print(
            f"at the gateway bench's {GATEWAY_BAR_RPS:,} req/s, {name} would use {share:.0f}% of one core"
        )
    print(wrk_line)


if __name__ == "__main__":
    main()

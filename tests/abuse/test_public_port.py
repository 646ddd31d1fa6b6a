"""Abuse of the public port (issue 9 items 7 and 8, the connection cap and EMFILE, and the
attacks that already held: slowloris, huge heads, request smuggling). Each is answered with one
clear line (a status and an error message, no traceback in the log) while a well-behaved openai
client on a keep-alive connection keeps being served within its normal latency."""

from __future__ import annotations

import json
import resource
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.harness import FAST_FLEET, Proc, Server, get_json, start_sim_engine, wait_until

MODEL = "chat"
# header_timeout: long enough for 64 KiB sent a byte per send, short for a quick slowloris test.
PUBLIC = """\
gateway:
  header_timeout: {header_timeout}
  body_timeout: 2s
  max_connections: {cap}
"""


class Site:
    def __init__(self, tmp: Path, cap: int = 64, fd_limit: int = 0, header_timeout: str = "8s") -> None:
        self.procs: list[Proc] = []
        engine, url = start_sim_engine(tmp, "engine", "--served-model-name", MODEL, "--ttft-ms", "1", "--itl-ms", "1")
        self.procs.append(engine)
        self.server = Server(tmp, FAST_FLEET + PUBLIC.format(cap=cap, header_timeout=header_timeout)
                             + f"endpoints:\n  - model: {MODEL}\n    url: {url}\n")
        if fd_limit:
            # The server's own process with a low fd limit: the public port hits EMFILE first.
            self.server.start = _start_limited(self.server, fd_limit)  # type: ignore[method-assign]
        self.procs.append(self.server.start())
        self.port = self.server.public_port

    def log(self) -> str:
        assert self.server.proc is not None
        return self.server.proc.log()

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop(timeout=5)
            p.kill_group()


def _start_limited(server: Server, limit: int):  # type: ignore[no-untyped-def]
    def start() -> Proc:
        args = ["server", "--config", str(server.config), "--listen", f"127.0.0.1:{server.public_port}",
                "--fleet-listen", f"127.0.0.1:{server.fleet_port}", "--state-dir", str(server.state_dir), "--insecure"]
        server.proc = Proc(server.name, args, server.tmp,
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
        wait_until(lambda: get_json(f"{server.url}/healthz")["status"] == "ok", "server /healthz", procs=[server.proc])
        return server.proc
    return start


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    s = Site(tmp_path_factory.mktemp("public"))
    try:
        yield s
    finally:
        s.close()
    assert "Traceback" not in s.log(), s.log()[-3000:]


class Client:
    """The well-behaved client: the official openai client, one keep-alive connection, one
    request after another, latencies recorded. Its normal latency is measured first."""

    def __init__(self, url: str) -> None:
        self.openai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.normal = statistics.median(self._one() for _ in range(20))
        self.bar = max(0.5, 5 * self.normal)  # generous: the machine is a shared 2-core box
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self) -> float:
        t0 = time.monotonic()
        r = self.openai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices
        return time.monotonic() - t0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.latencies.append(self._one())
            except Exception as exc:
                self.errors.append(repr(exc))
            time.sleep(0.01)  # ok: a client's think time

    def __enter__(self) -> Client:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # A short abuse case may end before the client's second request: the claim is that it
        # keeps being served, so let it finish three before judging (a deadline, not a sleep).
        wait_until(lambda: len(self.latencies) >= 3 or bool(self.errors), "the well-behaved client served")
        self._stop.set()
        self._thread.join(timeout=30)
        assert self.errors == [], self.errors[:3]
        assert self.latencies, "the well-behaved client was not served during the abuse"
        worst = max(self.latencies)
        assert worst <= self.bar, (f"well-behaved client took {worst:.3f}s (normal {self.normal:.3f}s, bar "
                                   f"{self.bar:.2f}s)")

    def say(self, case: str, outcome: str) -> None:
        worst = max(self.latencies, default=0.0)
        print(f"ABUSE {case}: {outcome}; well-behaved client: {len(self.latencies)} served, worst "
              f"{worst * 1000:.0f} ms "
              f"(normal {self.normal * 1000:.0f} ms)")


def exchange(port: int, data: bytes, pieces: int = 1, pause: float = 0.0) -> bytes:
    """Send `data` (in `pieces` sends, `pause` apart), then read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        step = max(1, len(data) // pieces)
        try:
            for i in range(0, len(data), step):
                sock.sendall(data[i : i + step])
                if pause:
                    time.sleep(pause)  # ok: the attacker's pacing
        except OSError:
            pass  # the server answered and closed before we were done sending
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except OSError:
            pass
        return reply


def one_line(reply: bytes) -> tuple[int, str]:
    """The status and the error message of a reply that must be one clear JSON error."""
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    message = json.loads(body)["error"]["message"]
    assert message and "\n" not in message and "Traceback" not in message
    return status, message


def server_cpu(site: Site) -> float:
    assert site.server.proc is not None
    fields = Path(f"/proc/{site.server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / resource_clock()


def resource_clock() -> float:
    import os

    return float(os.sysconf("SC_CLK_TCK"))


def test_json_nested_100000_deep_is_a_400(site: Site) -> None:
    body = b'{"model": "chat", "messages": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)) + body
    with Client(site.server.url) as good:
        replies = [exchange(site.port, request) for _ in range(20)]
        while len(good.latencies) < 10 and len(replies) < 500:  # the abuse lasts while the client is measured
            replies.append(exchange(site.port, request))
    statuses = {one_line(r) for r in replies}
    assert statuses == {(400, "the request body is nested too deeply (a JSON object with a `model` field is expected)")}
    good.say(f"JSON nested 100,000 deep ({len(replies)} requests)", "400 'the request body is nested too deeply'")
    assert "RecursionError" not in site.log()


def test_a_64k_head_a_byte_at_a_time_costs_little_cpu(site: Site) -> None:
    """The CPU a head sent a byte at a time costs grows with its length, not faster.

    A ratio inside one run (a 64 KiB head against a 16 KiB one, both a byte per send, three clients
    at once; linear reads about 4x), because the absolute figure follows the machine's load: the
    same build read 1.64 s against an absolute bar of 1.5 s in one CI run and 0.22 s in another
    (a loaded server reads many bytes per recv). The rescan-per-read bug itself is caught by the
    work counted in bytes (test_web_server's head_bytes_scanned, test_http1's HeadScanner);
    planted back, it read 6.0x here on a loaded machine, so this bar alone would not catch it.
    Under load the server reads many bytes per recv and the whole thing costs a few ticks, so
    the ratio is applied once the cost is large enough to be read.
    """

    def three_heads(pad: int) -> float:
        head = b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-pad: " + b"a" * pad + b"\r\n\r\n"
        cpu = server_cpu(site)
        results: list[bytes] = []
        threads = [threading.Thread(target=lambda: results.append(exchange(site.port, head, pieces=len(head))))
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(results) == 3 and all(r.startswith(b"HTTP/1.1 200") for r in results), [r[:40] for r in results]
        return server_cpu(site) - cpu

    with Client(site.server.url) as good:
        small = three_heads(15 * 1024)
        large = three_heads(63 * 1024)
    ratio = large / max(small, 0.05)  # CPU time is read in ticks of 0.01 s: a floor keeps one tick from deciding
    good.say("64 KiB head a byte at a time (3 clients at once)",
             f"answered; server CPU {large:.2f}s, against {small:.2f}s for 16 KiB heads: {ratio:.1f}x "
             "(bar 7x, linear 4x)")
    # Cheap is cheap: under 1 s for all three the growth cannot matter (the bug cost 2.0 s a head).
    assert large < 1.0 or ratio <= 7.0, (large, small, ratio)


def test_slowloris_and_huge_heads_and_smuggling_get_one_line_each(site: Site) -> None:
    cases = {
        "slowloris (a header byte every 0.1 s)": (b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 200, 200,
                                                  0.1),
        "100 KB header": (b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n", 1, 0.0),
        "1,000 headers": (b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + b"x-h: y\r\n" * 1000 + b"\r\n", 1, 0.0),
        "CL and TE": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n"
                      b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n", 1, 0.0),
        "two different CLs": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n"
                              b"content-length: 2\r\n\r\nab", 1, 0.0),
        "TE gzip": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n", 1, 0.0),
        "obs-fold": (b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: 1\r\n folded\r\n\r\n", 1, 0.0),
        "bare LF": (b"GET /healthz HTTP/1.1\r\nx-a: 1\nx-b: 2\r\n\r\n", 1, 0.0),
        # every line ended by LF alone: no CRLF CRLF ever comes (it waited out the header timeout)
        "LF-only head": (b"GET /healthz HTTP/1.1\nhost: x\nconnection: close\n\n", 1, 0.0),
    }
    expected = {"slowloris (a header byte every 0.1 s)": 408, "100 KB header": 431, "1,000 headers": 431,
                "CL and TE": 400, "two different CLs": 400, "TE gzip": 501, "obs-fold": 400, "bare LF": 400,
                "LF-only head": 400}
    seen: dict[str, tuple[int, str]] = {}
    with Client(site.server.url) as good:
        threads = [threading.Thread(target=lambda k=k, v=v: seen.__setitem__(k, one_line(exchange(site.port, *v))))
                   for k, v in cases.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert {k: v[0] for k, v in seen.items()} == expected, seen
    good.say("slowloris, huge heads, smuggling shapes", "; ".join(f"{k}: {v[0]} {v[1]!r}" for k, v in seen.items()))


def test_at_the_connection_cap_accept_pauses_with_one_line_a_second(site: Site) -> None:
    with Client(site.server.url) as good:  # its keep-alive connection is open before the flood
        t0 = time.monotonic()
        flood = []
        for _ in range(100):  # over the cap of 64: the rest wait in the listen backlog
            s = socket.create_connection(("127.0.0.1", site.port), timeout=30)
            flood.append(s)
        wait_until(lambda: "at its cap of 64 connections" in site.log(), "the cap logged", deadline=10)
        time.sleep(1.5)  # ok: the flood holds the cap a while (the log line must not repeat more than once a second)
        for s in flood:  # the flood gives up; accept resumes
            s.close()
        wait_until(lambda: get_json(f"{site.server.url}/healthz")["status"] == "ok", "a new connection served",
                   deadline=10)
        took = time.monotonic() - t0
    lines = site.log().count("at its cap of 64 connections")
    assert 1 <= lines <= took + 1, (lines, took)
    good.say("100 idle connections over a cap of 64",
             f"accept paused at the cap, {lines} log line(s) in {took:.1f}s; new "
             "connections served once the flood closed")


def test_out_of_file_descriptors_pauses_accept_with_one_line_a_second(tmp_path: Path) -> None:
    site = Site(tmp_path, cap=0, fd_limit=96, header_timeout="2s")
    try:
        with Client(site.server.url) as good:
            t0 = time.monotonic()
            flood = [socket.create_connection(("127.0.0.1", site.port), timeout=30) for _ in range(150)]
            wait_until(lambda: "accept failed with EMFILE" in site.log(), "EMFILE logged", deadline=10)
            for s in flood:
                assert s.recv(1) == b""  # closed after header_timeout, the waiting ones too
                s.close()
            took = time.monotonic() - t0
        log = site.log()
        lines = log.count("accept failed with EMFILE")
        assert 1 <= lines <= took + 1, (lines, took)
        assert "Traceback" not in log, log[-3000:]
        good.say("150 connections against a limit of 96 file descriptors",
                 f"accept paused at EMFILE, {lines} log line(s) in {took:.1f}s, no traceback")
    finally:
        site.close()

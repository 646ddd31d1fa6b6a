"""A stand-in llmgw server whose every string is hostile to a terminal (run as a process by
tests/e2e/test_ctl_hostile_output.py): `python -m tests.e2e.hostile_api PORTFILE`.

It answers the /api/v1 routes `llmgw ctl` reads with the shapes the real server sends, each
string field carrying ESC sequences (screen clear, window title, OSC 52 clipboard write, OSC 8
hyperlink), C1 controls, a bidi override and Rich markup; mutations get a hostile error.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

# Everything a terminal would act on, plus markup that once crashed `ctl nodes`.
EVIL = (
    "\x1b[2J\x1b[H"  # clear screen, cursor home
    "\x1b]0;pwned\x07"  # window title
    "\x1b]52;c;cm0gLXJmIH4=\x07"  # OSC 52: write the clipboard
    "\x1b]8;;https://evil.example/\x1b\\link\x1b]8;;\x1b\\"  # OSC 8 hidden hyperlink
    "\x9b31m\x9d0;t\x9c"  # C1 CSI / OSC / ST
    "\u202egnp.exe"  # bidi override
    "\x00\x08\x7f\r\n"
    "[/x][bold red]0.1.0[/x][link=https://evil.example]"
)


def evil(tag: str) -> str:
    return f"{tag}{EVIL}"


NODES = [{
    "id": evil("gpu-01"), "state": evil("ready"), "last_heartbeat_age": 1.5, "gpus": 8, "gpu_name": evil("H100"),
    "fabrics": [evil("ib0")], "ports": 4, "ports_active": 4, "version": evil("0.1.0[/x]"), "reason": evil("why"),
    "cert_days_left": 12.0, "gpu_note": evil("note"), "identity": evil("gpu-01"), "address": evil("10.0.0.1"),
}, {
    "id": evil("gpu-02"), "state": evil("lost"), "last_heartbeat_age": None, "gpus": 0, "gpu_name": "",
    "fabrics": [], "ports": 2, "ports_active": 1, "version": evil("v"), "reason": evil("gone"),
    "gpu_note": evil("no nvml"),
}]
REPLICAS = [{
    "id": evil("r-1"), "model": evil("llama"), "profile": evil("h100"), "state": "failed",
    "endpoint": evil("10.0.0.1:8000"),
    "age": 12.0, "reason": evil("exit 1"), "retry_in": 3.0,
    "shards": [{"node": evil("gpu-01"), "gpus": [0, 1], "rank": 0, "state": evil("failed"), "endpoint": evil("e")}],
    "tail": [evil("line one"), evil("all replicas ready")],
}, {
    "id": evil("r-2"), "model": evil("llama"), "profile": None, "state": evil("pending"), "endpoint": None,
    "age": 1.0, "reason": evil("no GPUs"), "shards": [], "tail": [evil("pending tail")],
}]
MODELS = [{"name": evil("llama"), "ready": 0, "replicas": 2, "profiles": [evil("h100")], "balancer": evil("p2c"),
           "source": evil("meta/llama"),
           "rollout": {"state": evil("rolling"), "note": evil("surging"), "replaced": 1, "total": 2,
                       "what": evil("args")}},
          {"name": "plain", "ready": 1, "replicas": 1, "profiles": ["tp1"], "balancer": "p2c", "source": "plain",
           "rollout": {"state": "halted", "note": evil("successor failed"), "replaced": 0, "total": 1,
                       "what": evil("args")}}]
ENDPOINTS = [{
    "model": evil("llama"), "endpoint": evil("10.0.0.1:8000"), "outstanding": 3, "breaker": evil("open"),
    "breaker_reason": evil("5 failures"), "violations": [evil("kv")], "engine_up": True,
    "load": {"running": 1, "waiting": 2, "kv_cache_usage": 0.5},
}]
DOCTOR = {"findings": [{"node": evil("gpu-01"), "check": evil("clock"), "status": "warn", "finding": evil("skew"),
                        "action": evil("fix ntp")}],
          "summary": {"ok": 0, "warn": 1, "crit": 0, "unknown": 0, "nodes": 1}, "status": "warn", "exit_code": 1,
          "took": 0.1}
EVENTS = [{"id": 1, "time": 1796158209.0, "kind": evil("node"), "node": evil("gpu-01"), "model": evil("llama"),
           "message": evil("node gone"), "detail": [evil("last line")]}]
DRAIN = {"node": "gpu-01", "items": [{"replica": evil("r-1"), "model": evil("llama"), "state": evil("ready"),
                                      "successor": evil("r-9"), "move": evil("failed"), "note": evil("no room")}],
         "down": [evil("r-2 down")], "failed": [evil("r-1 has no room")], "done": False, "in_progress": False}
FABRIC_TEST = [
    {"event": "start", "a": evil("gpu-01"), "b": evil("gpu-02"), "rails": [{}]},
    {"event": "rail_start", "rail": 0, "fabric": evil("ib"), "a": evil("mlx5_0:1"), "b": evil("mlx5_0:1")},
    {"event": "note", "node": evil("gpu-02"), "message": evil("installing perftest")},
    {"event": "rail", "rail": 0, "measured_gbps": 100.0, "expected_gbps": 400.0, "status": evil("crit"),
     "detail": evil("slow")},
    {"event": "done", "a": evil("gpu-01"), "b": evil("gpu-02"), "status": "crit", "exit_code": 2, "error": evil("cut"),
     "rails": [{"fabric": evil("ib"), "rail": 0, "a": evil("mlx5_0:1"), "b": evil("mlx5_0:1"), "measured_gbps": 100.0,
                "expected_gbps": 400.0, "ratio": 0.25, "status": evil("crit"), "detail": evil("slow")}]},
]
ROUTES = {"/api/v1/nodes": NODES, "/api/v1/replicas": REPLICAS, "/api/v1/models": MODELS,
          "/api/v1/endpoints": ENDPOINTS, "/api/v1/doctor": DOCTOR, "/api/v1/events": EVENTS,
          "/api/v1/nodes/gpu-01/drain": DRAIN, "/healthz": {"status": "ok"}}


class Handler(BaseHTTPRequestHandler):
    def _send(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()  # \u escapes: the bytes on the wire are plain ASCII
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        body = ROUTES.get(self.path)
        if body is None:
            self._send(404, {"error": {"message": evil("no route"), "type": "not_found"}})
        else:
            self._send(200, body)

    def do_POST(self) -> None:
        if self.path == "/api/v1/reload":
            self._send(200, {"ok": True, "message": evil("reloaded")})
        elif self.path == "/api/v1/nodes/gpu-01/drain":
            self._send(200, DRAIN)
        elif self.path == "/api/v1/fabric-tests":
            data = b"".join(json.dumps(line).encode() + b"\n" for line in FABRIC_TEST)
            self.send_response(200)
            self.send_header("content-type", "application/x-ndjson")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._send(409, {"error": {"message": evil("refused"), "type": "conflict"}})

    def do_DELETE(self) -> None:
        self._send(403, {"error": {"message": evil("forbidden"), "type": "forbidden"}})

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    server = HTTPServer(("127.0.0.1", 0), Handler)
    Path(sys.argv[1]).write_text(str(server.server_address[1]))
    server.serve_forever()


if __name__ == "__main__":
    main()

"""One rank of a Ray-mode replica, as one process the supervisor starts, watches and stops.

    python -m llmgw.agent.rayrank --address A --port P --head -- vllm serve ... (rank 0)
    python -m llmgw.agent.rayrank --address A --port P                          (ranks 1..N-1)

Rank 0 starts a Ray head on the master port, then runs the engine (vLLM with
`--distributed-executor-backend ray`) as its child. The others wait until the head answers
(a TCP connect to A:P, once a second), then `ray start --address A:P --block`. Either way a
SIGTERM stops the child and then `ray stop --force`: Ray's own daemons must not outlive the
shard (a stop stops all ranks, and their GPUs are free again).
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

WAIT_STEP = 1.0  # seconds between tries to reach the head


def _head_answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=WAIT_STEP):
            return True
    except OSError:
        return False


def _run(argv: list[str]) -> int:
    child = subprocess.Popen(argv)

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return child.wait()
    finally:
        subprocess.run(["ray", "stop", "--force"], check=False)


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.agent.rayrank")
    parser.add_argument("--address", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--head", action="store_true")
    parser.add_argument("engine", nargs=argparse.REMAINDER)
    opts = parser.parse_args(args)
    engine = opts.engine[1:] if opts.engine[:1] == ["--"] else opts.engine
    if opts.head:
        started = subprocess.run(["ray", "start", "--head", "--port", str(opts.port), "--node-ip-address", opts.address],
                                 check=False)
        if started.returncode != 0:
            print(f"llmgw: ray start --head exited {started.returncode}", file=sys.stderr, flush=True)
            return started.returncode
        return _run(engine)
    print(f"llmgw: waiting for the Ray head at {opts.address}:{opts.port}", flush=True)
    while not _head_answers(opts.address, opts.port):
        time.sleep(WAIT_STEP)  # ok: pacing the connect attempts to a head that is still starting
    return _run(["ray", "start", "--address", f"{opts.address}:{opts.port}", "--block"])


if __name__ == "__main__":
    sys.exit(main())

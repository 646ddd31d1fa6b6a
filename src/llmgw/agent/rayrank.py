"""One rank of a Ray-mode replica, as one process the supervisor starts, watches and stops.

    python -m llmgw.agent.rayrank --address A --port P --temp-dir D --head -- vllm serve ... (rank 0)
    python -m llmgw.agent.rayrank --address A --port P --temp-dir D                          (ranks 1..N-1)

Each rank runs a Ray node of its own, private to its shard, so that two Ray-mode shards on one
node (ranks of two replicas) never share or stop each other's Ray:

- `ray start … --block`, started in a session of its own (start_new_session) and stopped by
  signalling that session: SIGTERM (Ray's handler stops the daemons it started), then SIGKILL to
  whatever is left of it. Never `ray stop --force`: it stops every Ray process of the machine,
  every other shard's included (ray/scripts/scripts.py `stop`). `ray start` also gets the parent-
  death signal (SIGTERM), so a rank killed outright (the supervisor's SIGKILL after the grace)
  still takes its Ray with it.
- Its own ports, chosen here (free ports on the node's address, held until `ray start` runs):
  the GCS port is the master port placement gave rank 0; the Ray client server (default 10001),
  the dashboard agent (52365), node manager, object manager, metrics export, dashboard agent gRPC
  and runtime env agent ports are this shard's; `--include-dashboard=false` (its default port
  8265 would be the second head's collision); `--min-worker-port 0 --max-worker-port 0`: workers
  bind ports the kernel picks instead of two raylets handing out one range (10002-19999)
  (ray/_private/parameter.py: 0 means random). Every flag is in Ray 2.9's `ray start`, the
  oldest Ray vLLM 0.5.2 takes (requirements-cuda.txt: ray >= 2.9).
- Its own `--temp-dir` (the head's; Ray's other nodes use the head's path), under
  /tmp/llmgw-ray/, short: Ray puts unix sockets in it and a socket path is at most 107 bytes. It
  is removed when the rank ends cleanly and kept (the path is printed) when it failed.
- `--node-ip-address`: this node's address, the one the agent gave the rank as VLLM_HOST_IP
  (launch_env: the address its advertise_host stands for). vLLM's Ray executor compares its
  driver's IP (VLLM_HOST_IP) with Ray's node IPs, so both must be the one address.
- Rank 0 waits for its GCS port to answer, then runs the engine (vLLM with
  `--distributed-executor-backend ray`) with RAY_ADDRESS=A:P: `ray.init()` without an address
  would attach to whichever cluster started last on the node. The others wait until the head
  answers (a TCP connect to A:P, once a second), then join it.

A SIGTERM stops the engine (it has the same process group, so the supervisor's signal reaches it
too), then Ray. The rank's exit status is the engine's (rank 0) or Ray's (the others); a Ray that
dies under a running engine stops the engine and fails the rank.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from types import FrameType

from llmgw.agent import procs
from llmgw.agent.engines.multinode import RAY_TEMP_ROOT as TEMP_ROOT

WAIT_STEP = 1.0  # seconds between tries to reach the head
POLL = 0.2  # seconds between looks at the engine and Ray
RAY_STOP_GRACE = 10.0  # seconds Ray's own SIGTERM handler gets before what is left is killed
ENGINE_STOP_GRACE = 30.0  # seconds an engine gets to stop when its Ray died under it

# Per-node ports `ray start` binds, each given one the kernel says is free (Ray's default when
# not given): dashboard agent 52365 is fixed, so is the head's client server 10001.
NODE_PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
                   "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")
HEAD_PORT_FLAGS = ("--ray-client-server-port",)


def _free_ports(host: str, count: int) -> tuple[list[int], list[socket.socket]]:
    """`count` distinct ports the kernel says are free on `host`, with the sockets holding them
    (closed just before `ray start` binds them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held: list[socket.socket] = []
    for _ in range(count):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
        held.append(sock)
    return [int(s.getsockname()[1]) for s in held], held


def ray_command(opts: argparse.Namespace, ports: list[int]) -> list[str]:
    flags = NODE_PORT_FLAGS + (HEAD_PORT_FLAGS if opts.head else ())
    argv = ["ray", "start"]
    if opts.head:
        argv += ["--head", "--port", str(opts.port), "--temp-dir", opts.temp_dir, "--include-dashboard=false"]
    else:
        argv += ["--address", f"{opts.address}:{opts.port}"]
    argv += ["--node-ip-address", opts.node_ip_address]
    for flag, port in zip(flags, ports, strict=True):
        argv += [flag, str(port)]
    argv += ["--min-worker-port", "0", "--max-worker-port", "0", "--disable-usage-stats", "--block"]
    if opts.num_gpus is not None:
        argv += ["--num-gpus", str(opts.num_gpus)]
    return argv


def _private_dir(path: str) -> None:
    """Make `path` (and TEMP_ROOT) ours alone: a directory another user made there, or a
    symlink, is refused (it would hold this shard's Ray sockets)."""
    for directory in (TEMP_ROOT, path):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise SystemExit(f"llmgw: {directory} is not a directory of this user's; refusing to put Ray's "
                                 "sockets there") from None


def _pdeathsig() -> None:
    """In the child: SIGTERM when the rank dies (prctl PR_SET_PDEATHSIG), as Ray fate-shares."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _head_answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=WAIT_STEP):
            return True
    except OSError:
        return False


class Rank:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.ray: subprocess.Popen[bytes] | None = None
        self.engine: subprocess.Popen[bytes] | None = None
        self.stopping = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        if self.engine is not None and self.engine.poll() is None:
            self.engine.send_signal(signum)

    def start_ray(self) -> None:
        count = len(NODE_PORT_FLAGS) + (len(HEAD_PORT_FLAGS) if self.opts.head else 0)
        ports, held = _free_ports(self.opts.node_ip_address, count)
        argv = ray_command(self.opts, ports)
        print(f"llmgw: starting this rank's own Ray: {subprocess.list2cmdline(argv)}", flush=True)
        for sock in held:
            sock.close()
        self.ray = subprocess.Popen(argv, start_new_session=True, preexec_fn=_pdeathsig)

    def stop_ray(self) -> None:
        """SIGTERM to Ray's session, then SIGKILL to what is left of it after the grace."""
        ray = self.ray
        if ray is None:
            return
        procs.signal_session(ray.pid, signal.SIGTERM)
        deadline = time.monotonic() + RAY_STOP_GRACE
        while time.monotonic() < deadline:
            ray.poll()
            if not procs.session_members(ray.pid):
                break
            time.sleep(POLL)  # ok: waiting for Ray's daemons to exit
        left = procs.signal_session(ray.pid, signal.SIGKILL)
        if left:
            print(f"llmgw: killed {left} Ray process(es) still running {RAY_STOP_GRACE:g}s after SIGTERM", flush=True)
        ray.wait()

    def _wait(self, *children: subprocess.Popen[bytes], until_stopped: bool = False) -> subprocess.Popen[bytes] | None:
        """The first of `children` to exit (None: a stop came first and `until_stopped`)."""
        while True:
            for child in children:
                if child.poll() is not None:
                    return child
            if until_stopped and self.stopping:
                return None
            time.sleep(POLL)  # ok: polling two children, a signal interrupts it

    def run_head(self, engine_argv: list[str]) -> int:
        self.start_ray()
        assert self.ray is not None
        opts = self.opts
        while not _head_answers(opts.node_ip_address, opts.port):
            if self.ray.poll() is not None:
                print(f"llmgw: ray start --head exited {self.ray.returncode} before its GCS answered on "
                      f"{opts.node_ip_address}:{opts.port}", file=sys.stderr, flush=True)
                return self.ray.returncode or 1
            if self.stopping:
                return 0
            time.sleep(POLL)  # ok: the GCS is starting
        env = {**os.environ, "RAY_ADDRESS": f"{opts.address}:{opts.port}"}
        print(f"llmgw: Ray is up; starting the engine with RAY_ADDRESS={env['RAY_ADDRESS']}", flush=True)
        self.engine = subprocess.Popen(engine_argv, env=env)
        first = self._wait(self.engine, self.ray)
        if first is self.ray:
            print(f"llmgw: this rank's Ray exited ({self.ray.returncode}) under the engine; stopping the engine",
                  file=sys.stderr, flush=True)
            self.engine.terminate()
            try:
                self.engine.wait(ENGINE_STOP_GRACE)
            except subprocess.TimeoutExpired:
                self.engine.kill()
                self.engine.wait()
            return 1
        return self.engine.returncode

    def run_worker(self) -> int:
        opts = self.opts
        print(f"llmgw: waiting for the Ray head at {opts.address}:{opts.port}", flush=True)
        while not _head_answers(opts.address, opts.port):
            if self.stopping:
                return 0
            time.sleep(WAIT_STEP)  # ok: pacing the connect attempts to a head that is still starting
        self.start_ray()
        assert self.ray is not None
        self._wait(self.ray, until_stopped=True)  # a stop stops Ray (main's finally)
        return 0 if self.stopping else self.ray.returncode


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.agent.rayrank")
    parser.add_argument("--address", required=True, help="rank 0's address (the master address)")
    parser.add_argument("--port", type=int, required=True, help="the head's GCS port (the master port)")
    parser.add_argument("--temp-dir", required=True, help="this replica's Ray temp dir")
    parser.add_argument("--node-ip-address", default=os.environ.get("VLLM_HOST_IP", ""),
                        help="this node's address (default: VLLM_HOST_IP, which the agent sets)")
    parser.add_argument("--head", action="store_true")
    parser.add_argument("engine", nargs=argparse.REMAINDER)
    opts = parser.parse_args(args)
    if not opts.node_ip_address:
        print("llmgw: no address for this node's Ray (VLLM_HOST_IP is not set)", file=sys.stderr, flush=True)
        return 2
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    opts.num_gpus = len([g for g in visible.split(",") if g.strip()]) if visible is not None else None
    engine = opts.engine[1:] if opts.engine[:1] == ["--"] else opts.engine
    _private_dir(opts.temp_dir)
    rank = Rank(opts)
    signal.signal(signal.SIGTERM, rank.on_signal)
    signal.signal(signal.SIGINT, rank.on_signal)
    code = 1
    try:
        code = rank.run_head(engine) if opts.head else rank.run_worker()
    finally:
        rank.stop_ray()
        if code == 0 or rank.stopping:
            shutil.rmtree(opts.temp_dir, ignore_errors=True)
        else:
            print(f"llmgw: Ray's logs of this rank are in {opts.temp_dir}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""`make bench-fetch`: the agent's weight fetcher against `curl -o` on the same 2 GB file.

A sparse file of --size bytes is served by `llmgw sim fileserver` (its own process, sendfile)
on loopback. In the same run, alternating, each client fetches it --rounds times into --dest:

- `curl -s -o FILE URL` (the baseline: C, one read and one write per buffer);
- the fetcher as the agent runs it: llmgw.agent.weights.Weights.ensure on a trio loop, the
  download in its worker thread, into `.partial`, fsynced and renamed.

The best rate of each is printed, then the fetcher's peak RSS growth (VmHWM after the runs
less VmRSS before them, the peak reset through /proc/self/clear_refs), and last `ratio: R`
(fetcher ÷ curl). Bars: ratio ≥ 0.8, RSS growth < 64 MB.

--dest defaults to /dev/shm (memory) when it has room, so the figure is the clients' and not
the disk's; pass --dest DIR to measure onto a disk.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from llmgw.agent.weights import Weights
from llmgw.wire import messages as m

RATIO_BAR = 0.8
RSS_BAR = 64 << 20
LISTENING = re.compile(r"llmgw-sim-fileserver listening on (\S+):(\d+)")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux 4.0+)
        return True
    except OSError:
        return False


def _default_dest(size: int) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > size + (256 << 20):
        return shm
    return Path(tempfile.gettempdir())


def start_server(root: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "sim", "fileserver", "--root", str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        match = LISTENING.search(line)
        if match:
            # Drain its request log in the background so a full pipe never stalls it.
            subprocess.Popen(["cat"], stdin=proc.stdout, stdout=subprocess.DEVNULL)
            return proc, f"http://{match.group(1)}:{match.group(2)}"
    proc.kill()
    raise SystemExit("llmgw sim fileserver did not start")


def run_curl(url: str, out: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(["curl", "-s", "-f", "-o", str(out), url], check=True)
    took = time.perf_counter() - t0
    out.unlink()
    return took


def run_fetcher(url: str, dest: Path) -> float:
    cache = Path(tempfile.mkdtemp(prefix="bench-fetch-", dir=dest))
    weights = Weights(cache, cache, report_interval=1.0)
    spec = m.ShardSpec(shard_id="bench", replica_id="bench", model="bench", profile="bench", engine="sim", source=url)
    plan = weights.plan(spec)

    async def main() -> float:
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            await weights.ensure("bench", plan, t0 + 3600, nursery, lambda msg: None)
        return trio.current_time() - t0

    took = trio.run(main)
    assert Path(plan.target).stat().st_size > 0
    shutil.rmtree(cache)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=2 * 1024**3, help="bytes in the served file (sparse)")
    parser.add_argument("--rounds", type=int, default=3, help="fetches per client (best counts)")
    parser.add_argument("--dest", type=Path, default=None, help="where both clients write (default: /dev/shm if roomy)")
    args = parser.parse_args()
    if shutil.which("curl") is None:
        raise SystemExit("curl is not on PATH: it is the baseline of this benchmark")
    dest = args.dest or _default_dest(args.size)
    with tempfile.TemporaryDirectory(prefix="bench-fetch-src-") as src:
        served = Path(src) / "model.safetensors"
        with open(served, "wb") as fh:
            fh.truncate(args.size)
        server, base = start_server(Path(src))
        url = f"{base}/model.safetensors"
        try:
            print(f"bench-fetch: {args.size / 1e9:.2f} GB sparse file from {base} into {dest}, "
                  f"{args.rounds} rounds each")
            run_fetcher(url, dest)  # warm up: imports, the page cache of the source file
            rss_before = _status_kib("VmRSS") * 1024
            peak_reset = _reset_peak()
            curl_times: list[float] = []
            fetch_times: list[float] = []
            for _ in range(args.rounds):
                curl_times.append(run_curl(url, dest / "bench-fetch-curl.bin"))
                fetch_times.append(run_fetcher(url, dest))
            peak = _status_kib("VmHWM") * 1024
        finally:
            server.terminate()
            server.wait(timeout=10)
    curl_rate = args.size / min(curl_times)
    fetch_rate = args.size / min(fetch_times)
    growth = max(0, peak - rss_before)
    print(f"  curl -o:  {curl_rate / 1e6:8.0f} MB/s  (best of {args.rounds}: "
          + ", ".join(f"{args.size / t / 1e6:.0f}" for t in curl_times) + ")")
    print(f"  fetcher:  {fetch_rate / 1e6:8.0f} MB/s  (best of {args.rounds}: "
          + ", ".join(f"{args.size / t / 1e6:.0f}" for t in fetch_times) + ")")
    note = "" if peak_reset else " (peak since start: /proc/self/clear_refs not writable)"
    print(f"  fetcher peak RSS growth: {growth / 2**20:.1f} MB (bar < {RSS_BAR >> 20} MB){note}")
    ratio = fetch_rate / curl_rate
    ok = ratio >= RATIO_BAR and growth < RSS_BAR
    print(f"  bar: ratio >= {RATIO_BAR}, RSS growth < {RSS_BAR >> 20} MB: {'met' if ok else 'MISSED'}")
    print(f"ratio: {ratio:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

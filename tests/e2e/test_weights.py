"""Weights before launch, end to end (issue 12): a real server, agent, simulated engines and the
simulated file server (`llmgw sim fileserver`) as processes on loopback."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.harness import (
    FAST_AGENT,
    Proc,
    Server,
    ctl_json,
    engines_config,
    make_sim_node,
    one_error_line,
    replicas,
    run_llmgw,
    start_agent,
    wait_until,
)

FILESERVER_LISTENING = re.compile(r"^llmgw-sim-fileserver listening on (\S+):(\d+)$", re.M)


def start_fileserver(tmp: Path, root: Path, *args: str, name: str = "fileserver") -> tuple[Proc, str]:
    proc = Proc(name, ["sim", "fileserver", "--root", str(root), *args], tmp)
    host, port = wait_until(lambda: (m := FILESERVER_LISTENING.search(proc.log())) and m.groups(),
                            f"{name} to print its port", procs=[proc])
    return proc, f"http://{host}:{port}"


def sparse_file(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(b"llmgw weights ")
        fh.truncate(size)


def metric(server: Server, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def one_node(tmp_path: Path, procs: list[Proc], catalog: str, agent_extra: str = "") -> tuple[Server, Proc]:
    server = Server(tmp_path, engines_config(catalog))
    procs.append(server.start())
    agent_config = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT + agent_extra, "--gpus", "8")
    agent = start_agent(tmp_path, "gpu-01", agent_config, "--stop-engines-on-exit")
    procs.append(agent)
    return server, agent


def test_the_file_server_answers_ranges_and_logs_what_it_saw(tmp_path: Path, procs: list[Proc]) -> None:
    data = bytes(range(256)) * 64
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "w.bin").write_bytes(data)
    proc, url = start_fileserver(tmp_path, tmp_path / "files")
    procs.append(proc)
    whole = httpx.get(f"{url}/w.bin")
    assert whole.status_code == 200 and whole.content == data and whole.headers["accept-ranges"] == "bytes"
    part = httpx.get(f"{url}/w.bin", headers={"range": "bytes=1000-", "if-range": whole.headers["etag"]})
    assert part.status_code == 206 and part.content == data[1000:]
    assert part.headers["content-range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
    stale = httpx.get(f"{url}/w.bin", headers={"range": "bytes=1000-", "if-range": '"stale"'})
    assert stale.status_code == 200 and stale.content == data  # the validator changed: the whole file
    assert httpx.get(f"{url}/nope.bin").status_code == 404
    wait_until(lambda: "GET /w.bin range=bytes=1000- if-range=" in proc.log() and "-> 206" in proc.log(),
               "the request log", procs=[proc])


def test_the_file_server_refuses_a_root_that_is_not_a_directory_in_one_line(tmp_path: Path) -> None:
    result = run_llmgw("sim", "fileserver", "--root", str(tmp_path / "missing"))
    assert result.returncode == 1
    assert "not a directory" in one_error_line(result)


def test_a_path_missing_on_the_node_and_a_404_fail_before_launch_with_the_reason(tmp_path: Path,
                                                                                 procs: list[Proc]) -> None:
    (tmp_path / "files").mkdir()
    files, url = start_fileserver(tmp_path, tmp_path / "files")
    procs.append(files)
    catalog = f"""\
models:
  - name: nopath
    source: {tmp_path}/no-such-model
    profiles:
      - {{engine: sim, gpus: 1}}
  - name: gone
    source: {url}/gone/model.safetensors
    profiles:
      - {{engine: sim, gpus: 1, start_timeout: 30s}}
"""
    server, _ = one_node(tmp_path, procs, catalog)
    seen: dict[str, dict[str, Any]] = {}

    def failed() -> bool:
        for r in ctl_json(server.url, "replicas"):
            if r["state"] == "failed":
                seen[r["model"]] = r
        return seen.keys() >= {"nopath", "gone"}

    wait_until(failed, "both replicas failed", procs=procs, deadline=60)
    assert (f"not started: source {tmp_path}/no-such-model: no such file or "
            "directory on this node" in seen["nopath"]["reason"])
    assert f"not started: weights {url}/gone/model.safetensors: HTTP 404 Not Found" in seen["gone"]["reason"]
    logs = tmp_path / "gpu-01" / "work" / "logs"
    assert not list(logs.glob("*.log"))  # nothing was launched
    wait_until(lambda: metric(server, "llmgw_weights_fetch_failures_total", node="gpu-01", reason="http") >= 1,
               "the 404 counted in llmgw_weights_fetch_failures_total", procs=procs)


def test_a_model_by_url_is_fetched_once_and_the_engine_gets_the_local_path(tmp_path: Path, procs: list[Proc]) -> None:
    size = 3_000_000
    sparse_file(tmp_path / "files" / "model.safetensors", size)
    digest = hashlib.sha256((tmp_path / "files" / "model.safetensors").read_bytes()).hexdigest()
    files, url = start_fileserver(tmp_path, tmp_path / "files", "--drop-after", "1000000")
    procs.append(files)
    catalog = f"""\
models:
  - name: byurl
    source: {url}/model.safetensors
    replicas: 2
    profiles:
      - {{engine: sim, gpus: 1, sha256: {digest}}}
"""
    server, _ = one_node(tmp_path, procs, catalog)
    ready = wait_until(lambda: len(rs := [r for r in replicas(server) if r["state"] == "ready"]) == 2 and rs,
                       "both replicas ready", procs=procs, deadline=60)
    assert len(ready) == 2
    gets = re.findall(r"^GET /model.safetensors range=(\S+) if-range=(\S+) -> (\d+)$", files.log(), re.M)
    assert gets[0] == ("-", "-", "200")  # one download for both replicas, cut at 1 MB ...
    assert gets[1][0] == "bytes=1000000-" and gets[1][2] == "206"  # ... and resumed there
    assert len(gets) == 2
    cached = list((tmp_path / "gpu-01" / "work" / "models").glob("*/model.safetensors"))
    assert len(cached) == 1 and cached[0].stat().st_size == size
    assert not list(cached[0].parent.glob("*.partial*"))


def test_a_download_that_outlasts_start_timeout_fails_though_bytes_keep_arriving(tmp_path: Path,
                                                                                 procs: list[Proc]) -> None:
    sparse_file(tmp_path / "files" / "big.safetensors", 200_000_000)
    files, url = start_fileserver(tmp_path, tmp_path / "files", "--rate", "2MB")
    procs.append(files)
    catalog = f"""\
models:
  - name: slow
    source: {url}/big.safetensors
    profiles:
      - {{engine: sim, gpus: 1, start_timeout: 3s}}
"""
    server, _ = one_node(tmp_path, procs, catalog)
    failed = wait_until(lambda: next((r for r in replicas(server) if r["state"] == "failed"), None),
                        "the replica failed at its start_timeout", procs=procs, deadline=60)
    assert "not fetched within the start_timeout" in failed["reason"], failed
    assert re.search(r"\(\d+\.\d of 200\.0 MB so far\)", failed["reason"]), failed["reason"]


def test_a_slow_download_shows_in_ctl_replicas_with_rising_bytes_while_the_replica_stays_starting(
        tmp_path: Path, procs: list[Proc]) -> None:
    # 15 s at 2 MB/s: four `ctl` runs must fall inside the download, and under load (14-21 on
    # 2 cores) each took seconds; 12 MB (6 s) was over before the third sample.
    size = 30_000_000
    sparse_file(tmp_path / "files" / "model.safetensors", size)
    files, url = start_fileserver(tmp_path, tmp_path / "files", "--rate", "2MB")
    procs.append(files)
    # A source with credentials and a presigned query (issue 40, finding 3): what viewers see of
    # the download (GET /api/v1/replicas, ctl) must hold neither; the agent redacts it.
    secret = url.replace("http://", "http://fetcher:s3cret-pass@") + "/model.safetensors?X-Amz-Signature=sig-0123"
    catalog = f"""\
models:
  - name: slowfetch
    source: {secret}
    profiles:
      - {{engine: sim, gpus: 1, start_timeout: 2m}}
"""
    server, _ = one_node(tmp_path, procs, catalog)
    samples: list[dict[str, Any]] = []
    lines: list[str] = []

    def table_line(replica_id: str) -> str | None:
        table = run_llmgw("ctl", "--server", server.url, "replicas").stdout.splitlines()
        for i, line in enumerate(table):
            if line.lstrip().startswith("↓ model.safetensors") and i > 0 and table[i - 1].startswith(replica_id):
                return line
        return None

    def progressing() -> bool:
        # The JSON and the table are read in the same loop, while the download runs: on a loaded
        # machine the table read after it (a separate wait) found the download over (CI, 2026-12-04).
        [replica] = ctl_json(server.url, "replicas")
        if replica.get("progress") is not None:
            samples.append(replica)
            if not lines and (found := table_line(replica["id"])) is not None:
                lines.append(found)
        return len({s["progress"]["bytes"] for s in samples}) >= 3 and bool(lines)

    wait_until(progressing, "three different byte counts in ctl replicas -o json, and the download line in its table",
               procs=procs, deadline=60)
    for replica in samples:
        assert replica["state"] == "starting", replica  # bytes arriving are not a state change
        progress = replica["progress"]
        assert progress["source"] == f"{url}/model.safetensors"
        assert progress["total"] == size and 0 <= progress["bytes"] <= size
    counts = [s["progress"]["bytes"] for s in samples]
    assert counts == sorted(counts) and counts[-1] > counts[0]
    assert any(s["progress"]["rate"] > 0 for s in samples)
    api = next(r for r in replicas(server) if r["id"] == samples[0]["id"])
    # GET /api/v1/replicas too
    assert api["progress"] is None or api["progress"]["source"] == f"{url}/model.safetensors"
    # The catalog's own view (GET /api/v1/models, `ctl models`) shows the source without them too.
    models = ctl_json(server.url, "models")
    assert models[0]["source"] == f"{url}/model.safetensors", models
    seen = json.dumps(samples) + json.dumps(replicas(server)) + json.dumps(server.get("/api/v1/models"))
    seen += run_llmgw("ctl", "--server", server.url, "models").stdout
    assert "s3cret-pass" not in seen and "sig-0123" not in seen and "fetcher@" not in seen

    # The table: a line under the replica, not a column (read while the download runs, above).
    line = lines[0]
    assert re.search(r"↓ model\.safetensors  \d+\.\d / 30\.0 MB  \d+ %  \d+ (KB|MB)/s", line), line

    ready = wait_until(lambda: next((r for r in replicas(server) if r["state"] == "ready"), None), "the replica ready",
                       procs=procs, deadline=60)
    # The view shows a download only while the replica starts, so this cannot tell whether the
    # state change cleared it: test_weights_board.py checks that, on a replica still starting.
    assert ready["progress"] is None
    wait_until(lambda: metric(server, "llmgw_weights_bytes_total", node="gpu-01") == size,
               "llmgw_weights_bytes_total to count the file once", procs=procs)


def test_a_replica_restarted_mid_download_stops_waiting_and_its_successor_resumes(tmp_path: Path,
                                                                                  procs: list[Proc]) -> None:
    token = "ops-weights-1"
    # 15 s at 2 MB/s: four `ctl` runs must fall inside the download, and under load (14-21 on
    # 2 cores) each took seconds; 12 MB (6 s) was over before the third sample.
    size = 30_000_000
    sparse_file(tmp_path / "files" / "model.safetensors", size)
    files, url = start_fileserver(tmp_path, tmp_path / "files", "--rate", "2MB")
    procs.append(files)
    catalog = f"""\
api:
  operator_tokens: ["sha256:{hashlib.sha256(token.encode()).hexdigest()}"]
models:
  - name: restarted
    source: {url}/model.safetensors
    profiles:
      - {{engine: sim, gpus: 1, start_timeout: 2m}}
"""
    server = Server(tmp_path, engines_config(catalog), token=token)
    procs.append(server.start())
    agent_config = make_sim_node(tmp_path, "gpu-01", server.fleet_url, FAST_AGENT, "--gpus", "8")
    agent = start_agent(tmp_path, "gpu-01", agent_config, "--stop-engines-on-exit")
    procs.append(agent)
    first = wait_until(lambda: next((r for r in replicas(server)
                                     if (r.get("progress") or {}).get("bytes", 0) > 2_000_000),
                                    None), "the download under way", procs=procs, deadline=60)
    result = run_llmgw("ctl", "--server", server.url, "restart", first["id"], env={"LLMGW_TOKEN": token})
    assert result.returncode == 0, result.stderr
    ready = wait_until(lambda: next((r for r in replicas(server) if r["state"] == "ready"), None), "a replica ready",
                       procs=procs, deadline=60)
    assert ready["id"] != first["id"]
    gets = re.findall(r"^GET /model.safetensors range=(\S+) if-range=(\S+) -> (\d+)$", files.log(), re.M)
    assert gets[0][0] == "-" and len(gets) <= 2
    # The successor either joined the download before the old shard left it (one GET) or, the
    # download cancelled with nobody waiting, went on from the partial file (a second, resumed GET).
    for got in gets[1:]:
        assert int(got[0].removeprefix("bytes=").removesuffix("-")) >= 2_000_000 and got[2] == "206", gets
    assert f"shard {first['shards'][0]['shard_id']} stopped before it was launched" in agent.log()
    cached = list((tmp_path / "gpu-01" / "work" / "models").glob("*/model.safetensors"))
    assert len(cached) == 1 and cached[0].stat().st_size == size


def test_a_redirect_into_the_node_is_refused_and_a_same_host_redirect_still_fetches(tmp_path: Path,
                                                                                    procs: list[Proc]) -> None:
    """Issue 40, finding 4, as reported: the source's server answers 302 to a "metadata service"
    (here another port on loopback); the replica fails with one line naming the redirect, and
    the metadata service is never asked. Beside it, a mirror handing off on its own host works."""
    (tmp_path / "meta" / "latest" / "meta-data").mkdir(parents=True)
    (tmp_path / "meta" / "latest" / "meta-data" / "iam").write_text('{"AccessKeyId": "AKIA-node-role"}')
    meta, meta_url = start_fileserver(tmp_path, tmp_path / "meta", name="metadata")
    procs.append(meta)
    sparse_file(tmp_path / "files" / "store" / "good.safetensors", 2_000_000)
    files, url = start_fileserver(tmp_path, tmp_path / "files",
                                  "--redirect", f"/model.safetensors={meta_url}/latest/meta-data/iam",
                                  "--redirect", "/good.safetensors=/store/good.safetensors")
    procs.append(files)
    catalog = f"""\
models:
  - name: stolen
    source: {url}/model.safetensors
    profiles:
      - {{engine: sim, gpus: 1, start_timeout: 30s}}
  - name: mirrored
    source: {url}/good.safetensors
    profiles:
      - {{engine: sim, gpus: 1, start_timeout: 30s}}
"""
    server, _ = one_node(tmp_path, procs, catalog)
    states: dict[str, dict[str, Any]] = {}

    def settled() -> bool:  # the failed replica is retried: its failure is kept once seen
        for r in replicas(server):
            if states.get(r["model"], {}).get("state") not in ("failed", "ready"):
                states[r["model"]] = r
        return states.get("stolen", {}).get("state") == "failed" and states.get("mirrored", {}).get("state") == "ready"

    wait_until(settled, "the redirected replica failed and the mirrored one ready", procs=procs, deadline=60)
    meta_host = meta_url.removeprefix("http://")
    reason = states["stolen"]["reason"]
    assert (f"weights {url}/model.safetensors: redirect to {meta_url}/latest/meta-data/iam refused: {meta_host} is not "
            f"the source's host ({url.removeprefix('http://')}) nor in the catalog's "
            "allow_redirect_hosts") in reason, reason
    assert "\n" not in reason
    assert "GET " not in meta.log()  # the metadata service was never asked
    cached = list((tmp_path / "gpu-01" / "work" / "models").glob("*/*"))
    assert [p.name for p in cached] == ["good.safetensors"] and cached[0].stat().st_size == 2_000_000
    wait_until(lambda: metric(server, "llmgw_weights_fetch_failures_total", node="gpu-01", reason="redirect") >= 1,
               "the refusal counted in llmgw_weights_fetch_failures_total", procs=procs)

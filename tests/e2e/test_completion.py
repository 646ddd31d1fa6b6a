"""Dynamic shell completion end to end (issue 45): the installed `llmgw` console script, asked
through click's completion protocol (`_LLMGW_COMPLETE=bash_complete`, COMP_WORDS, COMP_CWORD)
as completions/llmgw.bash asks it, against a real server on loopback with simulated nodes, a
two-node replica and a discovered fabric; and real bash with completions/llmgw.bash sourced.

Names complete filtered by what is typed; a dead, refusing or hung server offers nothing,
within the deadline, silently; an answer is kept a few seconds in a private cache file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import (
    FAST_AGENT,
    SIM_FABRIC_FAST,
    Proc,
    Server,
    engines_config,
    free_port,
    llmgw_env,
    make_sim_fabric,
    make_sim_node,
    run_llmgw,
    start_agent,
    token_digest,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.prefix) / "bin" / "llmgw"  # the installed console script, as a shell runs it
TOKEN = "viewer-45-tab"
CONFIG = engines_config("""\
models:
  - name: chat
    replicas: 1
    profiles:
      - engine: sim
        gpus: 1
  - name: big
    replicas: 1
    profiles:
      - name: two-nodes
        engine: sim
        nodes: 2
        gpus: 2
gateway:
  workers: 2
""", f'api:\n  viewer_tokens: ["{token_digest(TOKEN)}"]\n') + SIM_FABRIC_FAST
# Seconds a TAB may take, beyond the same process completing a subcommand name (no server asked,
# measured just before), when the server is dead, refusing or hung: the completion's own 0.5 s
# budget and a margin (the issue: no hanging shell). A ratio to a baseline of the same run, not an
# absolute figure: under load the interpreter alone has taken 1.8 s to start here.
BUDGET = 1.0


class Fleet:
    def __init__(self, tmp: Path, server: Server, fabric: str, replicas: dict[str, dict[str, Any]]) -> None:
        self.tmp = tmp
        self.server = server
        self.fabric = fabric
        self.replicas = replicas  # model → its replica
        self.ca = tmp / "ca"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One fleet for the whole module (every test only reads it): gpu-01 and gpu-02 share the ib
    fabric (a simulated one their stand-in ibnetdiscover reports), gpu-03 has RoCE only."""
    tmp = tmp_path_factory.mktemp("completion")
    procs: list[Proc] = []
    try:
        server = Server(tmp, CONFIG, token=TOKEN)
        procs.append(server.start())
        make_sim_fabric(tmp / "fabric", ["gpu-01", "gpu-02"])
        for node, args in (("gpu-01", ("--ib-ports", "2", "--fabric", str(tmp / "fabric"))),
                           ("gpu-02", ("--ib-ports", "2", "--fabric", str(tmp / "fabric"))),
                           ("gpu-03", ("--ib-ports", "0", "--roce-ports", "2"))):
            config = make_sim_node(tmp, node, server.fleet_url, FAST_AGENT, "--gpus", "4", *args)
            procs.append(start_agent(tmp, node, config, "--stop-engines-on-exit"))

        def placed() -> dict[str, dict[str, Any]] | None:
            found = {r["model"]: r for r in server.get("/api/v1/replicas")}
            want = {"chat": 1, "big": 2}
            return found if all(len(found.get(m, {}).get("shards") or []) == n for m, n in want.items()) else None

        replicas = wait_until(placed, "chat placed, and big on two nodes", procs=procs)
        fabrics = wait_until(lambda: server.get("/api/v1/fabrics"), "the fabric discovered", procs=procs)
        wait_until(lambda: len(server.get("/api/v1/gateways")) == 2, "two gateway workers", procs=procs)
        wait_until(lambda: {n["id"]: n["fabrics"] for n in server.get("/api/v1/nodes")} ==
                   {"gpu-01": ["ib"], "gpu-02": ["ib"], "gpu-03": ["roce"]}, "three nodes with their fabrics",
                   procs=procs)
        fleet = Fleet(tmp, server, fabrics[0]["id"], replicas)
        for args in (("init",), ("node", "gpu-01"), ("node", "gpu-02"), ("operator", "alice"), ("gateway", "edge-1")):
            result = run_llmgw("ctl", "cert", args[0], *args[1:], "--dir", str(fleet.ca))
            assert result.returncode == 0, result.stderr
        yield fleet
    finally:
        for p in reversed(procs):
            p.stop(timeout=5)
            p.kill_group()
        from llmgw.demo import kill_leftover_engines

        kill_leftover_engines(tmp, pattern="**/shards/*.json")


def complete(words: str, env: dict[str, str] | None = None, cache: Path | None = None) -> tuple[list[str], float]:
    """What `llmgw WORDS<TAB>` offers (a trailing space: a new word), and how long it took. stderr
    must stay empty and the exit status 0, whatever the server did."""
    parts = words.split(" ")
    base = {"LLMGW_SERVER": "", "LLMGW_TOKEN": "", "LLMGW_CERT": "", "LLMGW_KEY": "", "LLMGW_CA": "",
            "LLMGW_CA_DIR": ""}
    full = llmgw_env({**base, **(env or {}), "COMP_WORDS": " ".join(["llmgw", *parts]), "COMP_CWORD": str(len(parts)),
                      "_LLMGW_COMPLETE": "bash_complete"})
    if not full["LLMGW_SERVER"]:
        del full["LLMGW_SERVER"]
    if cache is not None:
        full["XDG_CACHE_HOME"] = str(cache)
    started = time.monotonic()
    result = subprocess.run([str(SCRIPT)], env=full, capture_output=True, text=True, timeout=30)
    took = time.monotonic() - started
    assert result.returncode == 0 and result.stderr == "", (words, result.returncode, result.stderr)
    offered = []
    for line in filter(None, result.stdout.splitlines()):  # nothing to offer: one empty line
        kind, _, value = line.partition(",")
        assert kind == "plain", (words, result.stdout)
        offered.append(value)
    return offered, took


def names(fleet: Fleet, words: str, *, cache: Path, **extra: str) -> list[str]:
    return complete(words, {"LLMGW_SERVER": fleet.server.url, "LLMGW_TOKEN": TOKEN, **extra}, cache)[0]


def test_each_argument_completes_the_names_the_server_knows(fleet: Fleet, tmp_path: Path) -> None:
    chat, big = fleet.replicas["chat"]["id"], fleet.replicas["big"]["id"]
    ids = [r["id"] for r in fleet.server.get("/api/v1/replicas")]  # in the server's order
    targets = [x for r in fleet.server.get("/api/v1/replicas") for x in (r["model"], r["id"])]  # one replica a model
    assert sorted(ids) == sorted([chat, big])
    cases: list[tuple[str, list[str]]] = [
        # nodes, and only those starting with what is typed
        ("ctl drain g", ["gpu-01", "gpu-02", "gpu-03"]),
        ("ctl drain gpu-03", ["gpu-03"]),
        ("ctl drain x", []),
        ("ctl cordon gpu-0", ["gpu-01", "gpu-02", "gpu-03"]),
        ("ctl uncordon gpu-02", ["gpu-02"]),
        ("ctl doctor --node gpu-0", ["gpu-01", "gpu-02", "gpu-03"]),
        ("ctl forget ", ["gpu-01", "gpu-02", "gpu-03"]),
        ("ctl events --node gpu-01", ["gpu-01"]),
        # fabric-test A B: A has a peer on a fabric, B shares one with A
        ("ctl fabric-test ", ["gpu-01", "gpu-02"]),
        ("ctl fabric-test gpu-01 ", ["gpu-02"]),
        ("ctl fabric-test gpu-02 g", ["gpu-01"]),
        ("ctl fabric-test gpu-03 ", []),
        # replicas and their ranks
        ("ctl logs ", targets),
        ("ctl logs -f ", targets),
        ("ctl logs " + big[:5], [big]),
        ("ctl logs b", ["big", big]),
        ("ctl logs big --rank ", ["0", "1"]),
        (f"ctl logs {big} --shard ", ["0", "1"]),
        (f"ctl logs {chat} --shard ", ["0"]),
        (f"ctl logs {big} --shard 1", ["1"]),
        ("ctl restart ", ids),
        (f"ctl restart {chat}", [chat]),
        # models
        ("ctl rollout status ", ["chat", "big"]),
        ("ctl rollout status b", ["big"]),
        ("ctl replicas --model c", ["chat"]),
        ("ctl events --model ", ["chat", "big"]),
        # fabrics
        ("ctl fabrics ", [fleet.fabric]),
        ("ctl fabrics " + fleet.fabric[:6], [fleet.fabric]),
        ("ctl fabrics zz", []),
        # cert names from the CA directory; a gateway's also from the gateways following the server
        (f"ctl cert revoke --dir {fleet.ca} ", ["alice", "edge-1", "gpu-01", "gpu-02"]),
        (f"ctl cert node --dir {fleet.ca} gpu-0", ["gpu-01", "gpu-02"]),
        (f"ctl cert operator --dir {fleet.ca} ", ["alice"]),
        (f"ctl cert gateway --dir {fleet.ca} ", ["edge-1", "worker-0", "worker-1"]),
        (f"ctl cert gateway --dir {fleet.ca} w", ["worker-0", "worker-1"]),
    ]
    wrong = []
    for words, expected in cases:
        got = names(fleet, words, cache=tmp_path / "cache")
        if got != expected:
            wrong.append((words, got, expected))
    assert wrong == [], "\n".join(map(repr, wrong))

    # The same options as the command: --server and --token typed, no environment; LLMGW_CA_DIR for cert.
    assert complete(f"ctl --server {fleet.server.url} --token {TOKEN} drain gpu-01",
                    cache=tmp_path / "c2")[0] == ["gpu-01"]
    assert complete("ctl cert node gpu-02", {"LLMGW_CA_DIR": str(fleet.ca)}, cache=tmp_path / "c2")[0] == ["gpu-02"]
    # Without a server named, `ctl cert gateway` asks none (cert works on local files).
    assert complete("ctl cert gateway ", {"LLMGW_CA_DIR": str(fleet.ca)}, cache=tmp_path / "c2")[0] == ["edge-1"]


class Hung:
    """A socket that accepts connections and never answers (`trickle`: answers a status line,
    then one byte of header every 0.1 s, forever: each read is quick, the answer never ends)."""

    def __init__(self, trickle: bool = False) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.trickle = trickle
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():  # the accept timeout paces the trickle
            try:
                conn = self.listener.accept()[0]
                self.held.append(conn)
                if self.trickle:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nx-trickle: ")
            except TimeoutError:
                pass
            except OSError:
                return
            for conn in self.held if self.trickle else ():
                with contextlib.suppress(OSError):
                    conn.send(b"x")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.listener.close()
        for s in self.held:
            s.close()


@pytest.fixture
def hung() -> Iterator[dict[str, str]]:
    servers = {"a hung server": Hung(), "a trickling server": Hung(trickle=True)}
    yield {what: h.url for what, h in servers.items()}
    for h in servers.values():
        h.close()


def test_no_server_a_wrong_token_or_a_hung_server_offer_nothing_quickly(fleet: Fleet, hung: dict[str, str],
                                                                       tmp_path: Path) -> None:
    cases = {
        "no server": {"LLMGW_SERVER": f"http://127.0.0.1:{free_port()}", "LLMGW_TOKEN": TOKEN},
        "a wrong token": {"LLMGW_SERVER": fleet.server.url, "LLMGW_TOKEN": "not-the-token"},
        "no token": {"LLMGW_SERVER": fleet.server.url},
        **{what: {"LLMGW_SERVER": url, "LLMGW_TOKEN": TOKEN} for what, url in hung.items()},
        "https to a plain port": {"LLMGW_SERVER": fleet.server.url.replace("http:", "https:"), "LLMGW_TOKEN": TOKEN},
        "a token in cleartext to another machine": {"LLMGW_SERVER": "http://192.0.2.1:9", "LLMGW_TOKEN": TOKEN},
    }
    for what, env in cases.items():
        for words in ("ctl drain g", "ctl logs -f ", "ctl fabric-test gpu-01 "):
            local, baseline = complete("ctl dra", env, cache=tmp_path / "cache")  # a subcommand: nothing asked
            assert local == ["drain"], local
            offered, took = complete(words, env, cache=tmp_path / "cache")
            assert offered == [], (what, words, offered)
            assert took - baseline < BUDGET, (f"{what}: `{words}<TAB>` took {took:.2f}s, a local completion "
                                              f"{baseline:.2f}s")
    # A wrong token's empty answer is kept for that token only: the right one still gets the names.
    assert names(fleet, "ctl drain g", cache=tmp_path / "cache") == ["gpu-01", "gpu-02", "gpu-03"]


class OneAnswer:
    """An HTTP server on loopback that answers one GET, then never again (with `tls`: HTTPS,
    skipping connections whose handshake fails, and noting the client certificate's name)."""

    def __init__(self, body: list[dict[str, Any]], tls: ssl.SSLContext | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.tls = tls
        self.requests: list[bytes] = []
        self.clients: list[str] = []
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.listener.getsockname()[1]}"
        data = json.dumps(body).encode()
        self.answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                       b"%d\r\n\r\n%s" % (len(data), data))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.requests:
            conn, _ = self.listener.accept()
            try:
                if self.tls is not None:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                    self.clients.append(dict(x[0] for x in conn.getpeercert()["subject"])["commonName"])
                self.requests.append(conn.recv(65536))
                conn.sendall(self.answer)
            except (OSError, KeyError):
                continue  # a refused handshake: wait for the next TAB
            finally:
                conn.close()
        self.listener.close()  # a second TAB that asks finds nobody: only the cache can answer it


def test_an_answer_is_kept_a_few_seconds_in_a_private_file(tmp_path: Path) -> None:
    server = OneAnswer([{"id": "gpu-01", "fabrics": ["ib"]}, {"id": "gpu-02", "fabrics": ["ib"]},
                        {"id": "evil\x1b]0;x\x07", "fabrics": []}, {"id": "two\nlines", "fabrics": []}])
    env = {"LLMGW_SERVER": server.url, "LLMGW_TOKEN": "tok-secret-45"}
    cache = tmp_path / "cache"
    assert complete("ctl drain ", env, cache)[0] == ["gpu-01", "gpu-02"]  # control characters never reach a shell
    request = server.requests[0].decode().lower()
    assert request.startswith("get /api/v1/nodes http/1.1\r\n") and "authorization: bearer tok-secret-45\r\n" in request
    # The second TAB (and a different prefix) is answered from the cache: the server is gone.
    assert complete("ctl cordon gpu-02", env, cache)[0] == ["gpu-02"]
    assert len(server.requests) == 1

    directory = cache / "llmgw" / "complete"
    [entry] = list(directory.iterdir())
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and stat.S_IMODE(entry.stat().st_mode) == 0o600
    text = entry.read_text()
    assert "tok-secret-45" not in text and "tok-secret-45" not in entry.name  # keyed by the credential's hash
    assert json.loads(text)["records"] == [{"name": "gpu-01", "fabrics": ["ib"]}, {"name": "gpu-02", "fabrics": ["ib"]}]
    # Another token or another server is another entry, asked afresh (here: nobody answers).
    assert complete("ctl drain ", {**env, "LLMGW_TOKEN": "other"}, cache)[0] == []
    assert len(list(directory.glob("*.json"))) == 2
    # Past its few seconds an entry is asked again (here: nobody answers, so nothing is offered).
    old = json.loads(text)
    old["at"] -= 60
    entry.write_text(json.dumps(old))
    assert complete("ctl drain ", env, cache)[0] == []


def test_over_https_with_the_commands_ca_and_client_certificate(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    for args in (("init",), ("server", "--ip", "127.0.0.1"), ("operator", "alice")):
        assert run_llmgw("ctl", "cert", *args, "--dir", str(ca)).returncode == 0
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(ca / "server.crt", ca / "server.key")
    tls.verify_mode = ssl.CERT_REQUIRED
    tls.load_verify_locations(ca / "ca.crt")
    server = OneAnswer([{"id": "gpu-07", "fabrics": []}], tls=tls)
    client = {"LLMGW_CERT": str(ca / "operator-alice.crt"), "LLMGW_KEY": str(ca / "operator-alice.key")}
    # Without --ca the server's certificate is not trusted: nothing offered, nothing said.
    assert complete(f"ctl --server {server.url} drain ", client, tmp_path / "cache")[0] == []
    offered, _ = complete(f"ctl --server {server.url} --ca {ca / 'ca.crt'} drain ", client, tmp_path / "cache")
    assert offered == ["gpu-07"] and server.clients == ["alice"]  # the operator certificate went along


# Each shell's own way to press TAB on `llmgw WORDS`, with the generated script sourced. zsh
# without zle: compadd and _describe stand in for the builtins, printing what they were handed.
SHELLS = {
    "bash": lambda script, parts: ["bash", "--norc", "--noprofile", "-c",
                                   f"source {shlex.quote(str(script))}\n"
                                   f"COMP_WORDS=({' '.join(shlex.quote(p) for p in parts)}); "
                                   f"COMP_CWORD={len(parts) - 1}\n"
                                   "_llmgw_completion llmgw\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n"],
    "zsh": lambda script, parts: ["zsh", "-f", "-c",
                                  "compdef() { :; }\ncompadd() { local name=${@[-1]}; print -rl -- ${(P)name}; }\n"
                                  "_describe() { print -rl -- ${(P)3}; }\n"
                                  f"source {shlex.quote(str(script))}\n"
                                  f"words=({' '.join(shlex.quote(p) for p in parts)}); CURRENT={len(parts)}\n"
                                  "_llmgw_completion\n"],
    "fish": lambda script, parts: ["fish", "--no-config", "-c",
                                   f"source {shlex.quote(str(script))}; complete -C {shlex.quote(' '.join(parts))}"],
}
SCRIPTS = {"bash": "llmgw.bash", "zsh": "_llmgw", "fish": "llmgw.fish"}


def shell_completion(shell: str, words: str, env: dict[str, str]) -> list[str]:
    """What TAB offers in a real `shell` that sourced our completions/ script for it."""
    parts = ["llmgw", *words.split(" ")]  # a trailing space: an empty word being completed
    full = llmgw_env({**env, "PATH": f"{SCRIPT.parent}{os.pathsep}{os.environ.get('PATH', '')}"})
    result = subprocess.run(SHELLS[shell](ROOT / "completions" / SCRIPTS[shell], parts), env=full, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0 and result.stderr == "", (shell, result.returncode, result.stderr)
    return [line.split("\t")[0] for line in result.stdout.splitlines() if line]


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_a_real_shell_lists_node_names(fleet: Fleet, tmp_path: Path, shell: str) -> None:
    if shutil.which(shell) is None:
        if shell == "bash":
            raise AssertionError("bash is needed: it is the shell the issue is about")
        pytest.skip(f"no {shell} on this machine")
    env = {"LLMGW_SERVER": fleet.server.url, "LLMGW_TOKEN": TOKEN, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    assert shell_completion(shell, "ctl drain g", env) == ["gpu-01", "gpu-02", "gpu-03"]
    assert shell_completion(shell, "ctl fabric-test gpu-01 ", env) == ["gpu-02"]
    by_model = [r for m in ("big", "chat") for r in fleet.server.get("/api/v1/replicas") if r["model"] == m]
    assert shell_completion(shell, "ctl logs -f ", env) == [x for r in by_model for x in (r["model"], r["id"])]
    assert shell_completion(shell, "ctl drain g", {**env, "LLMGW_TOKEN": "wrong"}) == []

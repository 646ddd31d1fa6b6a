"""`llmgw ctl cert` through the real CLI (`python -m llmgw`), checked by openssl and by a real
TLS handshake with the files it wrote."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from llmgw.tls import client_context, peer_common_name, peer_is_operator, server_context
from tests.e2e.needs import debian_program

pytestmark = pytest.mark.e2e



def llmgw(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("LLMGW_CA_DIR", None)
    env.pop("LLMGW_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args], capture_output=True, text=True, timeout=60, env=env, cwd=cwd
    )


def cert(*args: str) -> subprocess.CompletedProcess[str]:
    return llmgw("ctl", "cert", *args)


def ok(*args: str) -> subprocess.CompletedProcess[str]:
    result = cert(*args)
    assert result.returncode == 0, f"llmgw ctl cert {' '.join(args)} failed: {result.stderr}"
    return result


def fails(code: int, *args: str) -> str:
    """Run, expect exit `code`, and return the single error line."""
    result = cert(*args)
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("llmgw: error: ")
    return lines[0]


def openssl_path() -> str:
    return debian_program(("openssl",), "openssl")


def openssl(*args: str) -> str:
    result = subprocess.run([openssl_path(), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA with a server, a node and an operator certificate, all made by the CLI."""
    ca = tmp_path_factory.mktemp("cli") / "ca"
    ok("init", "--dir", str(ca), "--name", "test cluster CA")
    ok("server", "--dir", str(ca), "--host", "ctrl", "--host", "ctrl.example.com", "--ip", "127.0.0.1",
       "--ip", "10.0.0.5")
    ok("node", "gpu-01", "--dir", str(ca))
    ok("operator", "alice", "--dir", str(ca))
    return ca


def test_openssl_verifies_what_ctl_cert_wrote(cluster: Path) -> None:
    ca = str(cluster / "ca.crt")
    for name, purpose in (("server", "sslserver"), ("node-gpu-01", "sslclient"), ("operator-alice", "sslclient")):
        out = openssl("verify", "-x509_strict", "-purpose", purpose, "-CAfile", ca, str(cluster / f"{name}.crt"))
        assert out.strip() == f"{cluster / name}.crt: OK"
    # A node certificate is not a server certificate.
    bad = subprocess.run(
        [openssl_path(), "verify", "-purpose", "sslserver", "-CAfile", ca, str(cluster / "node-gpu-01.crt")],
        capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode != 0


def test_openssl_shows_sans_and_usages(cluster: Path) -> None:
    server = openssl("x509", "-noout", "-text", "-in", str(cluster / "server.crt"))
    assert "DNS:ctrl, DNS:ctrl.example.com, IP Address:127.0.0.1, IP Address:10.0.0.5" in server
    assert "TLS Web Server Authentication" in server
    assert "TLS Web Client Authentication" not in server
    node = openssl("x509", "-noout", "-text", "-in", str(cluster / "node-gpu-01.crt"))
    assert "TLS Web Client Authentication" in node and "CN = gpu-01" in node
    operator = openssl("x509", "-noout", "-text", "-in", str(cluster / "operator-alice.crt"))
    assert "OU = operators" in operator and "CN = alice" in operator
    ca = openssl("x509", "-noout", "-text", "-in", str(cluster / "ca.crt"))
    assert "CA:TRUE" in ca and "Certificate Sign, CRL Sign" in ca and "Subject Key Identifier" in ca
    assert "X509v3 Basic Constraints: critical" in ca


@pytest.mark.parametrize("key_type", ["rsa-3072", "ed25519"])
def test_other_key_types_verify(tmp_path: Path, key_type: str) -> None:
    ca = tmp_path / "ca"
    ok("init", "--dir", str(ca), "--key-type", key_type)
    ok("node", "n1", "--dir", str(ca), "--key-type", key_type)
    openssl("verify", "-x509_strict", "-CAfile", str(ca / "ca.crt"), str(ca / "node-n1.crt"))
    shown = json.loads(ok("show", str(ca / "node-n1.crt"), "-o", "json").stdout)
    assert shown["key_type"] == key_type


def test_key_files_are_0600(cluster: Path) -> None:
    for key in ("ca.key", "server.key", "node-gpu-01.key", "operator-alice.key"):
        assert _mode(cluster / key) == 0o600, key
    assert _mode(cluster / "server.crt") == 0o644


def test_init_twice_fails_and_keeps_the_first_ca(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    ok("init", "--dir", str(ca))
    before = {name: (ca / name).read_bytes() for name in ("ca.crt", "ca.key")}
    line = fails(1, "init", "--dir", str(ca))
    assert "a CA already exists" in line and "--force" in line
    assert {name: (ca / name).read_bytes() for name in ("ca.crt", "ca.key")} == before
    ok("init", "--dir", str(ca), "--force")
    assert (ca / "ca.key").read_bytes() != before["ca.key"]
    assert _mode(ca / "ca.key") == 0o600


def test_json_output_parses(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    init = json.loads(ok("init", "--dir", str(ca), "--days", "30", "-o", "json").stdout)
    assert init["kind"] == "ca" and init["is_ca"] is True and init["days_left"] == pytest.approx(30, abs=0.01)
    server = json.loads(ok("server", "--dir", str(ca), "--ip", "127.0.0.1", "--host", "ctrl", "-o", "json").stdout)
    assert server["sans"] == ["DNS:ctrl", "IP:127.0.0.1"] and "serverAuth" in server["usages"]
    assert server["path"] == str(ca / "server.crt") and server["key"] == str(ca / "server.key")
    node = json.loads(ok("node", "gpu-01", "--dir", str(ca), "--days", "7", "-o", "json").stdout)
    assert node["common_name"] == "gpu-01" and node["usages"] == ["digitalSignature", "clientAuth"]
    assert 6.9 < node["days_left"] <= 7
    listed = json.loads(ok("list", "--dir", str(ca), "-o", "json").stdout)
    assert [(i["kind"], i["serial"]) for i in listed] == [
        ("ca", init["serial"]),
        ("server", server["serial"]),
        ("node", node["serial"]),
    ]
    for field in ("subject", "sans", "usages", "serial", "not_after", "days_left", "status"):
        assert all(field in i for i in listed)
    shown = json.loads(ok("show", str(ca / "node-gpu-01.crt"), "-o", "json").stdout)
    assert shown["serial"] == node["serial"] and shown["not_after"] == node["not_after"]


def test_table_output_for_people(cluster: Path) -> None:
    table = ok("list", "--dir", str(cluster)).stdout
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["KIND", "NAME", "SANS"]
    assert any(line.split()[:2] == ["server", "ctrl"] and "IP:10.0.0.5" in line for line in lines)
    assert any(line.split()[:2] == ["operator", "alice"] for line in lines)
    shown = ok("show", str(cluster / "server.crt")).stdout
    assert "DNS:ctrl, DNS:ctrl.example.com, IP:127.0.0.1, IP:10.0.0.5" in shown


def test_errors_are_one_line_with_the_right_exit_code(cluster: Path, tmp_path: Path) -> None:
    assert "invalid node id 'gpu 01'" in fails(2, "node", "gpu 01", "--dir", str(cluster))
    assert "at least one --host or --ip" in fails(2, "server", "--dir", str(cluster), "--out", str(tmp_path / "s"))
    assert "--ip 'ctrl' is not an IP address" in fails(2, "server", "--dir", str(cluster), "--ip", "ctrl")
    # A remote gateway named like the server's own workers would share their `worker` label in /metrics.
    assert "gateway name 'worker-0' is what the server calls its own gateway workers" in \
        fails(2, "gateway", "worker-0", "--dir", str(cluster))
    assert not (cluster / "gateway-worker-0.crt").exists()
    before = (cluster / "node-gpu-01.crt").read_bytes()
    line = fails(1, "node", "gpu-01", "--dir", str(cluster))
    assert "node-gpu-01.crt already exists; pass --force" in line
    assert (cluster / "node-gpu-01.crt").read_bytes() == before
    assert "no CA in" in fails(1, "list", "--dir", str(tmp_path / "empty"))
    assert "does not exist" in fails(2, "show", str(tmp_path / "missing.crt"))
    assert "holds a private key" in fails(2, "show", str(cluster / "ca.key"))
    # A bad flag is click's usage error: exit 2.
    assert cert("init", "--dir", str(tmp_path / "x"), "--key-type", "dsa").returncode == 2


def test_out_prefix_and_force(cluster: Path, tmp_path: Path) -> None:
    out = tmp_path / "etc" / "agent"
    written = json.loads(ok("node", "gpu-02", "--dir", str(cluster), "--out", str(out), "-o", "json").stdout)
    assert written["path"] == f"{out}.crt" and _mode(Path(f"{out}.key")) == 0o600
    fails(1, "node", "gpu-02", "--dir", str(cluster), "--out", str(out))
    again = json.loads(ok("node", "gpu-02", "--dir", str(cluster), "--out", str(out), "--force", "-o", "json").stdout)
    assert again["serial"] != written["serial"]
    listed = json.loads(ok("list", "--dir", str(cluster), "-o", "json").stdout)
    statuses = {i["serial"]: i["status"] for i in listed}
    # The replaced node certificate is denied, not merely superseded: its key must stop working.
    assert statuses[written["serial"]] == "revoked" and statuses[again["serial"]] == "ok"


def test_show_says_what_list_says(cluster: Path, tmp_path: Path) -> None:
    """One source of status (issue 46, item 7): `show` of a revoked certificate said `ok`."""
    out = tmp_path / "gpu-07"
    issued = json.loads(ok("node", "gpu-07", "--dir", str(cluster), "--out", str(out), "-o", "json").stdout)
    kept = tmp_path / "gpu-07-before-revoke.crt"
    kept.write_bytes(Path(f"{out}.crt").read_bytes())
    assert json.loads(ok("show", str(kept), "--dir", str(cluster), "-o", "json").stdout)["status"] == "ok"
    ok("revoke", issued["serial"], "--dir", str(cluster))
    listed = {i["serial"]: i["status"] for i in json.loads(ok("list", "--dir", str(cluster), "-o", "json").stdout)}
    assert listed[issued["serial"]] == "revoked"
    assert json.loads(ok("show", str(kept), "--dir", str(cluster), "-o", "json").stdout)["status"] == "revoked"
    table = ok("show", str(kept), "--dir", str(cluster)).stdout
    assert "revoked" in table and f"the CA in {cluster}" in table
    # In the CA's own directory the CA is found without --dir; elsewhere the table says it read the dates only.
    assert json.loads(ok("show", str(cluster / "server.crt"), "-o", "json").stdout)["status"] == "ok"
    assert "its dates only" in ok("show", str(kept)).stdout
    other = tmp_path / "other"
    ok("init", "--dir", str(other))
    assert json.loads(ok("show", str(kept), "--dir", str(other), "-o", "json").stdout)["status"] == "other CA"


async def test_files_from_the_cli_make_a_working_mutual_tls_connection(cluster: Path) -> None:
    """The fleet port's set-up, end to end: CLI-written files, a TCP listener, an agent-side dial."""
    server_ctx = server_context(str(cluster / "server.crt"), str(cluster / "server.key"), str(cluster / "ca.crt"), True)
    seen: list[tuple[str | None, bool]] = []
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def handle(tcp: trio.SocketStream) -> None:
        stream = trio.SSLStream(tcp, server_ctx, server_side=True)
        await stream.do_handshake()
        seen.append((peer_common_name(stream), peer_is_operator(stream)))
        await stream.send_all(b"ok")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        for name in ("node-gpu-01", "operator-alice"):
            client_ctx = client_context(str(cluster / "ca.crt"), str(cluster / f"{name}.crt"),
                                        str(cluster / f"{name}.key"))
            with trio.fail_after(10):
                stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=client_ctx)
                assert await stream.receive_some(2) == b"ok"
                await stream.aclose()
        nursery.cancel_scope.cancel()
    assert seen == [("gpu-01", False), ("alice", True)]


def test_leaf_validity_is_cut_to_the_ca_and_said_so(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    ok("init", "--dir", str(ca), "--days", "10")
    result = ok("node", "gpu-01", "--dir", str(ca), "--days", "365", "-o", "json")
    assert "validity cut to the CA's own expiry" in result.stderr
    ca_info = json.loads(ok("show", str(ca / "ca.crt"), "-o", "json").stdout)
    assert json.loads(result.stdout)["not_after"] == ca_info["not_after"]

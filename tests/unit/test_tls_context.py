"""Building SSL contexts: settings, and one-line UsageErrors that name the bad file."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from llmgw.errors import UsageError
from llmgw.tls import ca as store
from llmgw.tls import client_context, server_context


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ctx") / "ca"
    now = time.time()
    store.init_ca(root, now=now)
    store.issue_server(root, hosts=["ctrl"], ips=["127.0.0.1"], now=now)
    store.issue_client(root, "node", "gpu-01", now=now)
    return root


def _usage_error(func, *args, **kwargs) -> str:
    with pytest.raises(UsageError) as err:
        func(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_server_context_settings(pki: Path) -> None:
    fleet = server_context(str(pki / "server.crt"), str(pki / "server.key"), str(pki / "ca.crt"), True)
    assert fleet.verify_mode == ssl.CERT_REQUIRED
    assert fleet.minimum_version == ssl.TLSVersion.TLSv1_2
    public = server_context(str(pki / "server.crt"), str(pki / "server.key"), str(pki / "ca.crt"), False)
    assert public.verify_mode == ssl.CERT_OPTIONAL
    plain = server_context(str(pki / "server.crt"), str(pki / "server.key"))
    assert plain.verify_mode == ssl.CERT_NONE
    assert all(c["protocol"] != "TLSv1.2" or "GCM" in c["name"] or "CHACHA20" in c["name"] for c in fleet.get_ciphers())


def test_client_context_verifies_server_and_name(pki: Path) -> None:
    ctx = client_context(str(pki / "ca.crt"), str(pki / "node-gpu-01.crt"), str(pki / "node-gpu-01.key"))
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.get_ca_certs()[0]["subject"] == ((("organizationName", "llmgw"),), (("commonName", "llmgw CA"),))


def test_missing_files_are_named(pki: Path) -> None:
    missing = str(pki / "nope.crt")
    assert _usage_error(server_context, missing, str(pki / "server.key")) == (
        f"certificate file {missing} does not exist")
    missing_key = str(pki / "nope.key")
    assert missing_key in _usage_error(server_context, str(pki / "server.crt"), missing_key)
    assert "nope-ca.crt" in _usage_error(client_context, str(pki / "nope-ca.crt"))


def test_key_not_matching_the_certificate(pki: Path) -> None:
    message = _usage_error(server_context, str(pki / "server.crt"), str(pki / "node-gpu-01.key"))
    assert message == (
        f"key file {pki / 'node-gpu-01.key'} does not match certificate {pki / 'server.crt'}; "
        "use the .key written next to that .crt"
    )


def test_encrypted_key_is_refused_with_a_way_out(pki: Path, tmp_path: Path) -> None:
    key = serialization.load_pem_private_key((pki / "server.key").read_bytes(), password=None)
    encrypted = tmp_path / "enc.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    message = _usage_error(server_context, str(pki / "server.crt"), str(encrypted))
    assert message.startswith(f"key file {encrypted} is encrypted")


def test_swapped_and_garbage_files(pki: Path, tmp_path: Path) -> None:
    assert "holds a private key, not a certificate" in _usage_error(
        server_context, str(pki / "server.key"), str(pki / "server.crt")
    )
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    assert f"{garbage} holds no certificate" in _usage_error(client_context, str(garbage))
    assert f"key file {garbage} holds no private key" in _usage_error(server_context, str(pki / "server.crt"),
                                                                      str(garbage))


def test_half_a_client_pair_and_client_certs_without_ca(pki: Path) -> None:
    assert "needs both cert and key" in _usage_error(client_context, str(pki / "ca.crt"), str(pki / "node-gpu-01.crt"))
    assert "needs a CA file" in _usage_error(
        server_context, str(pki / "server.crt"), str(pki / "server.key"), None, True
    )


def _unprivileged(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run Python code in a process that file permissions apply to. As root (CI runs as root,
    and root reads files whatever their mode) util-linux's setpriv, which every Debian has,
    first drops every capability, CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH among them: the
    process keeps uid 0, so it still reaches a checkout under /root (which `nobody` could not),
    but it can no longer read what a file's mode forbids."""
    cmd = [sys.executable, "-c", code, *args]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv, "this test needs setpriv (util-linux) to drop root's capabilities"
        cmd = [setpriv, "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


SERVER_CONTEXT = """\
import sys
from llmgw.errors import UsageError
from llmgw.tls import server_context
try:
    server_context(sys.argv[1], sys.argv[2])
except UsageError as exc:
    print(exc)
    sys.exit(2)
"""


def test_unreadable_key(pki: Path, tmp_path: Path) -> None:
    """Not skipped as root: run where the file's mode applies, as root or not."""
    key = tmp_path / "locked.key"
    key.write_bytes((pki / "server.key").read_bytes())
    key.chmod(0o600)
    readable = _unprivileged(SERVER_CONTEXT, str(pki / "server.crt"), str(key))
    assert readable.returncode == 0, (readable.stdout, readable.stderr)  # the same process reads it while it may
    key.chmod(0)
    result = _unprivileged(SERVER_CONTEXT, str(pki / "server.crt"), str(key))
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == f"cannot read key file {key}: permission denied\n"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o606])
def test_a_key_others_can_read_is_refused(pki: Path, tmp_path: Path, mode: int) -> None:
    """Independent of the uid: root (CI) is refused a loose key as much as anyone."""
    key = tmp_path / "loose.key"
    key.write_bytes((pki / "server.key").read_bytes())
    key.chmod(mode)
    message = _usage_error(server_context, str(pki / "server.crt"), str(key))
    assert f"key file {key} is mode {mode:04o}" in message and f"chmod 600 {key}" in message
    node_key = tmp_path / "node.key"
    node_key.write_bytes((pki / "node-gpu-01.key").read_bytes())
    node_key.chmod(mode)
    assert f"chmod 600 {node_key}" in _usage_error(client_context, str(pki / "ca.crt"), str(pki / "node-gpu-01.crt"),
                                                   str(node_key))
    node_key.chmod(0o600)
    client_context(str(pki / "ca.crt"), str(pki / "node-gpu-01.crt"), str(node_key))


class _Listener:
    ssl_context: ssl.SSLContext | None = None


def test_server_tls_rebuilds_from_renewed_files_and_keeps_the_running_context_on_a_bad_one(tmp_path: Path) -> None:
    from llmgw.tls.context import ServerTls

    root = tmp_path / "ca"
    now = time.time()
    store.init_ca(root, now=now)
    store.issue_server(root, hosts=["ctrl"], ips=["127.0.0.1"], now=now)
    tls = ServerTls(str(root / "server.crt"), str(root / "server.key"), str(root / "ca.crt"))
    listener = _Listener()
    tls.attach(listener)
    first, digest = tls.context, tls.digest
    assert listener.ssl_context is first and first.verify_mode == ssl.CERT_OPTIONAL
    assert first.get_ca_certs() and tls.reload() is False and tls.context is first  # unchanged files

    store.issue_server(root, hosts=["ctrl"], ips=["127.0.0.1"], now=now, force=True)  # renewed in place
    assert tls.reload() is True and tls.digest != digest
    assert listener.ssl_context is tls.context is not first

    renewed = tls.context
    shutil.copy(root / "ca.key", root / "server.key")  # a key of another pair
    message = _usage_error(tls.reload)
    assert "does not match certificate" in message
    assert tls.context is renewed and listener.ssl_context is renewed

"""The CA directory: init, issuing, records, refusals to overwrite, file modes."""

from __future__ import annotations

import stat
from pathlib import Path

import msgspec
import pytest
from cryptography import x509

from llmgw.errors import LlmgwError, UsageError
from llmgw.tls import ca as store
from llmgw.tls.info import cert_not_after, days_left, load_certificate

NOW = 1_750_000_000.0


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "ca"
    store.init_ca(directory, now=NOW)
    return directory


def test_init_writes_key_0600_and_ca_certificate(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "ca"
    info = store.init_ca(directory, now=NOW, name="prod CA", days=100)
    assert _mode(directory / "ca.key") == 0o600
    assert _mode(directory) == 0o700
    cert = load_certificate(str(directory / "ca.crt"))
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert info.kind == "ca" and info.common_name == "prod CA" and info.days_left == 100.0
    assert not list(directory.glob(".*tmp"))  # no temporary left behind


def test_init_refuses_an_existing_ca_and_leaves_it_intact(ca_dir: Path) -> None:
    before = {p.name: p.read_bytes() for p in (ca_dir / "ca.crt", ca_dir / "ca.key")}
    with pytest.raises(LlmgwError) as err:
        store.init_ca(ca_dir, now=NOW + 10)
    assert "already exists" in str(err.value) and "--force" in str(err.value)
    assert {p.name: p.read_bytes() for p in (ca_dir / "ca.crt", ca_dir / "ca.key")} == before


def test_init_refuses_a_half_ca_too(tmp_path: Path) -> None:
    (tmp_path / "ca.key").write_bytes(b"precious")
    with pytest.raises(LlmgwError, match=r"ca\.key"):
        store.init_ca(tmp_path, now=NOW)
    assert (tmp_path / "ca.key").read_bytes() == b"precious"
    assert not (tmp_path / "ca.crt").exists()


def test_init_force_replaces(ca_dir: Path) -> None:
    old = (ca_dir / "ca.crt").read_bytes()
    store.init_ca(ca_dir, now=NOW, force=True)
    assert (ca_dir / "ca.crt").read_bytes() != old
    assert _mode(ca_dir / "ca.key") == 0o600


def test_issue_node_writes_files_and_a_record(ca_dir: Path) -> None:
    issued = store.issue_client(ca_dir, "node", "gpu-01", now=NOW)
    crt, key = ca_dir / "node-gpu-01.crt", ca_dir / "node-gpu-01.key"
    assert issued.info.path == str(crt) and issued.info.key == str(key)
    assert _mode(key) == 0o600 and _mode(crt) == 0o644
    cert = load_certificate(str(crt))
    cert.verify_directly_issued_by(load_certificate(str(ca_dir / "ca.crt")))
    records = list((ca_dir / "issued").glob("*.json"))
    assert len(records) == 1
    record = msgspec.json.decode(records[0].read_bytes(), type=store.IssuedRecord)
    assert record.kind == "node" and record.common_name == "gpu-01"
    assert record.serial == format(cert.serial_number, "x") == records[0].stem
    assert record.cert == str(crt.resolve()) and record.issued_at == NOW
    assert x509.load_pem_x509_certificate(record.pem.encode()) == cert


def test_issue_refuses_to_overwrite_without_force(ca_dir: Path) -> None:
    store.issue_client(ca_dir, "node", "gpu-01", now=NOW)
    crt = ca_dir / "node-gpu-01.crt"
    before = crt.read_bytes(), (ca_dir / "node-gpu-01.key").read_bytes()
    with pytest.raises(LlmgwError, match="already exists; pass --force"):
        store.issue_client(ca_dir, "node", "gpu-01", now=NOW)
    assert (crt.read_bytes(), (ca_dir / "node-gpu-01.key").read_bytes()) == before
    assert len(list((ca_dir / "issued").glob("*.json"))) == 1
    store.issue_client(ca_dir, "node", "gpu-01", now=NOW + 1, force=True)
    assert crt.read_bytes() != before[0]


def test_an_existing_key_alone_blocks_issuing(ca_dir: Path) -> None:
    (ca_dir / "operator-alice.key").write_bytes(b"someone's key")
    with pytest.raises(LlmgwError, match=r"operator-alice\.key already exists"):
        store.issue_client(ca_dir, "operator", "alice", now=NOW)
    assert (ca_dir / "operator-alice.key").read_bytes() == b"someone's key"


@pytest.mark.parametrize(
    ("out", "expected"),
    [
        ("elsewhere/agent", "elsewhere/agent"),
        ("elsewhere/agent.crt", "elsewhere/agent"),
        ("elsewhere/", "elsewhere/node-n1"),
    ],
)
def test_out_prefix(tmp_path: Path, ca_dir: Path, out: str, expected: str) -> None:
    issued = store.issue_client(ca_dir, "node", "n1", now=NOW, out=f"{tmp_path}/{out}")
    assert issued.info.path == str(tmp_path / expected) + ".crt"
    assert Path(issued.info.key or "").name == Path(expected).name + ".key"
    assert (tmp_path / (expected + ".key")).exists()


def test_issue_needs_a_ca(tmp_path: Path) -> None:
    with pytest.raises(LlmgwError, match=r"no CA in .*cert init"):
        store.issue_client(tmp_path, "node", "gpu-01", now=NOW)


def test_mismatched_ca_key_is_reported(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    store.init_ca(a, now=NOW)
    store.init_ca(b, now=NOW)
    (a / "ca.key").write_bytes((b / "ca.key").read_bytes())
    with pytest.raises(LlmgwError, match="does not match"):
        store.issue_client(a, "node", "gpu-01", now=NOW)


def test_server_needs_a_name(ca_dir: Path) -> None:
    with pytest.raises(UsageError, match="at least one --host or --ip"):
        store.issue_server(ca_dir, hosts=[], ips=[], now=NOW)
    issued = store.issue_server(ca_dir, hosts=[], ips=["10.0.0.5"], now=NOW)
    assert issued.info.common_name == "10.0.0.5" and issued.info.sans == ["IP:10.0.0.5"]


def test_list_shows_ca_then_issued_with_status(tmp_path: Path, ca_dir: Path) -> None:
    store.issue_server(ca_dir, hosts=["ctrl"], ips=["127.0.0.1"], now=NOW)
    store.issue_client(ca_dir, "node", "gpu-01", now=NOW + 1)
    store.issue_client(ca_dir, "node", "gpu-01", now=NOW + 2, force=True)
    store.issue_client(ca_dir, "operator", "alice", now=NOW + 3)
    store.issue_client(ca_dir, "node", "old", now=NOW + 4, not_after=NOW - 86400)
    store.issue_server(ca_dir, hosts=["ctrl"], ips=["127.0.0.1"], now=NOW + 4.5, force=True)
    infos = store.list_certificates(ca_dir, now=NOW + 5)
    assert [(i.kind, i.common_name, i.status) for i in infos] == [
        ("ca", "llmgw CA", "ok"),
        ("server", "ctrl", "superseded"),  # a server certificate is not a client identity: not denied
        ("server", "ctrl", "ok"),
        ("node", "gpu-01", "revoked"),  # replaced with --force: its key must stop working
        ("node", "gpu-01", "ok"),
        ("node", "old", "expired"),
        ("operator", "alice", "ok"),
    ]
    server = infos[2]
    assert server.sans == ["DNS:ctrl", "IP:127.0.0.1"] and "serverAuth" in server.usages
    # After re-creating the CA, what the old one issued is flagged.
    store.init_ca(ca_dir, now=NOW + 6, force=True)
    statuses = {i.status for i in store.list_certificates(ca_dir, now=NOW + 7) if i.kind != "ca"}
    assert statuses == {"other CA"}


def test_cert_not_after_and_days_left(ca_dir: Path) -> None:
    issued = store.issue_client(ca_dir, "node", "gpu-01", now=NOW, days=10)
    path = issued.info.path
    assert cert_not_after(path) == NOW + 10 * 86400
    assert days_left(path, NOW) == 10.0
    assert days_left(path, NOW + 11 * 86400) == -1.0
    with pytest.raises(UsageError, match="does not exist"):
        cert_not_after(str(ca_dir / "missing.crt"))


# -- directory and key modes (issue 21 item 10). Mode bits only: these hold when run as root. --


def test_init_tightens_a_loose_directory(tmp_path: Path) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o777)
    store.init_ca(directory, now=NOW)
    assert _mode(directory) == 0o700


def test_init_refuses_a_directory_it_cannot_tighten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "theirs"
    directory.mkdir()
    directory.chmod(0o755)

    def not_owner(path: object, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(store.os, "chmod", not_owner)
    with pytest.raises(LlmgwError) as err:
        store.init_ca(directory, now=NOW)
    assert f"{directory} is mode 0755" in str(err.value) and f"chmod 700 {directory}" in str(err.value)
    assert not (directory / "ca.key").exists()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_ca_key_others_can_access_is_refused(ca_dir: Path, mode: int) -> None:
    (ca_dir / "ca.key").chmod(mode)
    with pytest.raises(UsageError) as err:
        store.issue_client(ca_dir, "node", "gpu-01", now=NOW)
    assert f"key file {ca_dir / 'ca.key'} is mode {mode:04o}" in str(err.value)
    assert f"chmod 600 {ca_dir / 'ca.key'}" in str(err.value)
    (ca_dir / "ca.key").chmod(0o400)
    store.issue_client(ca_dir, "node", "gpu-01", now=NOW)


# -- kinds and revocation (issue 21 items 3 and 4, issue 20's viewer kind) --


def test_viewer_kind(ca_dir: Path) -> None:
    issued = store.issue_client(ca_dir, "viewer", "grafana", now=NOW)
    assert issued.info.kind == "viewer" and "OU=viewers" in issued.info.subject
    assert issued.info.path.endswith("viewer-grafana.crt") and "clientAuth" in issued.info.usages
    with pytest.raises(UsageError, match="invalid operator name"):
        store.issue_client(ca_dir, "viewer", "bad name", now=NOW)


def test_one_name_holds_one_client_kind(ca_dir: Path) -> None:
    store.issue_client(ca_dir, "node", "gpu-01", now=NOW)
    for kind in ("operator", "viewer", "gateway"):
        for force in (False, True):
            with pytest.raises(LlmgwError, match="'gpu-01' already has a node certificate"):
                store.issue_client(ca_dir, kind, "gpu-01", now=NOW, force=force, out=str(ca_dir / f"x-{force}"))
    store.issue_client(ca_dir, "node", "gpu-01", now=NOW + 1, force=True)  # the same kind, replaced
    # A server certificate is no client identity; an expired or revoked one frees the name.
    store.issue_server(ca_dir, hosts=["gpu-01"], ips=[], now=NOW)
    store.issue_client(ca_dir, "operator", "old", now=NOW, not_after=NOW - 86400)
    store.issue_client(ca_dir, "node", "old", now=NOW)
    store.revoke(ca_dir, "gpu-01", now=NOW + 2)
    store.issue_client(ca_dir, "operator", "gpu-01", now=NOW + 3)


def test_force_reissue_denies_the_replaced_certificate(ca_dir: Path) -> None:
    first = store.issue_client(ca_dir, "node", "gpu-01", now=NOW)
    second = store.issue_client(ca_dir, "node", "gpu-01", now=NOW + 1, force=True)
    assert second.revoked == first.info.serial
    deny = store.deny_list(ca_dir)
    assert [(r.serial, r.common_name, r.kind) for r in deny.revoked] == [(first.info.serial, "gpu-01", "node")]
    assert deny.revoked[0].reason == f"superseded by {second.info.serial}"
    assert _mode(ca_dir / "revoked.json") == 0o644 and not list(ca_dir.glob(".*tmp"))


def test_revoke_by_serial_prefix_or_name(ca_dir: Path) -> None:
    assert store.deny_list(ca_dir).revoked == []  # init wrote an empty list
    a = store.issue_client(ca_dir, "node", "gpu-01", now=NOW).info.serial
    b = store.issue_client(ca_dir, "operator", "alice", now=NOW).info.serial
    result = store.revoke(ca_dir, a[:10].upper(), now=NOW, reason="stolen")
    assert [r.serial for r in result.revoked] == [a] and result.already == []
    assert store.revoke(ca_dir, a, now=NOW).already == [a]
    assert [r.serial for r in store.revoke(ca_dir, "alice", now=NOW).revoked] == [b]
    assert store.deny_list(ca_dir).serials() == {int(a, 16), int(b, 16)}
    statuses = {i.common_name: i.status for i in store.list_certificates(ca_dir, now=NOW)}
    assert statuses == {"llmgw CA": "ok", "gpu-01": "revoked", "alice": "revoked"}
    with pytest.raises(UsageError, match="no certificate with serial or name 'nobody'"):
        store.revoke(ca_dir, "nobody", now=NOW)


def test_a_damaged_deny_list_is_one_line(ca_dir: Path) -> None:
    from llmgw.tls.revocation import Revocations, read_deny_list

    path = ca_dir / "revoked.json"
    path.write_text('{"revoked": [{"serial": "zz"}]}')
    with pytest.raises(UsageError, match=f"deny list {path} is not a deny list"):
        read_deny_list(path)
    with pytest.raises(UsageError, match="does not exist"):
        Revocations(str(ca_dir / "missing.json"))


def test_the_server_keeps_its_deny_list_when_the_new_file_is_bad(ca_dir: Path) -> None:
    from llmgw.tls.revocation import Revocations

    serial = store.issue_client(ca_dir, "node", "gpu-01", now=NOW).info.serial
    revocations = Revocations(str(ca_dir / "revoked.json"))
    assert revocations.denied == frozenset()
    store.revoke(ca_dir, serial, now=NOW)
    assert revocations.reload() == "deny list: 1 revoked serial(s)"
    assert revocations.denied == {int(serial, 16)}
    (ca_dir / "revoked.json").write_text("{not json")
    assert revocations.reload().startswith("deny list not reloaded")
    assert revocations.denied == {int(serial, 16)}

"""File modes through the real commands: `ctl cert init` makes its directory private, and the
server, the agent and `ctl` refuse a private key that group or others can read (issue 21 item 10).

Mode bits only, never "can this uid read it": these run, and must pass, as root too (CI).
"""

from __future__ import annotations

import stat
from pathlib import Path

from tests.e2e.harness import free_port, one_error_line, run_llmgw


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_cert_init_makes_its_directory_0700(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    result = run_llmgw("ctl", "cert", "init", "--dir", str(loose))
    assert result.returncode == 0, result.stderr
    assert _mode(loose) == 0o700 and _mode(loose / "ca.key") == 0o600
    fresh = tmp_path / "a" / "b"
    assert run_llmgw("ctl", "cert", "init", "--dir", str(fresh)).returncode == 0
    assert _mode(fresh) == 0o700


def test_server_agent_and_ctl_refuse_loose_keys(tmp_path: Path) -> None:
    cadir = tmp_path / "ca"
    for args in (("init",), ("server", "--ip", "127.0.0.1"), ("node", "gpu-01"), ("operator", "alice")):
        result = run_llmgw("ctl", "cert", *args, "--dir", str(cadir))
        assert result.returncode == 0, result.stderr
    server_key, node_key, op_key = cadir / "server.key", cadir / "node-gpu-01.key", cadir / "operator-alice.key"
    for key in (server_key, node_key, op_key):
        key.chmod(0o644)

    cfg = tmp_path / "server.yaml"
    cfg.write_text(f"tls:\n  ca: {cadir / 'ca.crt'}\n  cert: {cadir / 'server.crt'}\n  key: {server_key}\n")
    result = run_llmgw("server", "--config", str(cfg), "--listen", f"127.0.0.1:{free_port()}",
                       "--fleet-listen", f"127.0.0.1:{free_port()}")
    assert result.returncode == 2
    assert (f"key file {server_key} is mode 0644" in one_error_line(result)
            and f"chmod 600 {server_key}" in result.stderr)

    agent_cfg = tmp_path / "agent.yaml"
    agent_cfg.write_text(f"server: https://127.0.0.1:{free_port()}\nnode_id: gpu-01\ntls:\n  ca: {cadir / 'ca.crt'}\n"
                         f"  cert: {cadir / 'node-gpu-01.crt'}\n  key: {node_key}\n")
    result = run_llmgw("agent", "--config", str(agent_cfg))
    assert result.returncode == 2
    assert f"chmod 600 {node_key}" in one_error_line(result)

    result = run_llmgw("ctl", "--server", f"https://127.0.0.1:{free_port()}", "--ca", str(cadir / "ca.crt"),
                       "--cert", str(cadir / "operator-alice.crt"), "--key", str(op_key), "nodes")
    assert result.returncode == 2
    assert f"chmod 600 {op_key}" in one_error_line(result)

    # Issuing from a CA whose key others can read is refused too.
    (cadir / "ca.key").chmod(0o640)
    result = run_llmgw("ctl", "cert", "node", "gpu-02", "--dir", str(cadir))
    assert result.returncode == 2 and f"chmod 600 {cadir / 'ca.key'}" in one_error_line(result)

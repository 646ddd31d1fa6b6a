"""The agent's fabric tools, run as real processes: output back raw (compressed when large),
a missing tool said so, a hung tool killed with its children at the timeout, the cap kept."""

from __future__ import annotations

import os
import stat
import time
import zlib
from pathlib import Path

import pytest

from llmgw.agent import fabric_tools
from llmgw.agent.fabric_tools import FabricTools
from llmgw.wire import messages as m


def tool(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def tools_dir(tmp_path: Path) -> Path:
    tool(tmp_path, "ibnetdiscover", 'echo "args: $*"; echo "#"')
    tool(tmp_path, "saquery", 'echo "saquery $*"')
    return tmp_path


def test_both_tools_found_means_the_discover_feature(tools_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert FabricTools(str(tools_dir)).features == [m.FEATURE_DISCOVER]
    (tools_dir / "saquery").unlink()
    assert FabricTools(str(tools_dir)).features == []


async def test_output_comes_back_raw_with_the_port_arguments(tools_dir: Path) -> None:
    result = await FabricTools(str(tools_dir)).run(m.Discover(request_id="r1", tool=m.TOOL_SMIR, device="mlx5_2",
                                                              port=1))
    assert result.ok and result.encoding == "" and result.data == b"saquery -C mlx5_2 -P 1 SMIR\n"
    result = await FabricTools(str(tools_dir)).run(m.Discover(request_id="r2", tool=m.TOOL_IBNETDISCOVER))
    assert result.ok and result.data.startswith(b"args: \n")


async def test_large_output_is_compressed(tools_dir: Path) -> None:
    tool(tools_dir, "ibnetdiscover",
         "i=0; while [ $i -lt 4000 ]; do echo '[1]\t\"H-0002c902002789ac\"[1] # \"x HCA-1\" lid 1 4xSDR'; i=$((i+1)); "
         "done")
    result = await FabricTools(str(tools_dir)).run(m.Discover(request_id="r", tool=m.TOOL_IBNETDISCOVER))
    assert result.ok and result.encoding == "zlib" and result.size > fabric_tools.COMPRESS_ABOVE
    assert len(zlib.decompress(result.data)) == result.size


async def test_a_hung_tool_is_killed_with_its_children(tools_dir: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    tool(tools_dir, "ibnetdiscover", f"sleep 300 & echo $! > {pidfile}; echo partial; wait")
    started = time.monotonic()
    result = await FabricTools(str(tools_dir)).run(m.Discover(request_id="r", tool=m.TOOL_IBNETDISCOVER, timeout=0.5))
    assert time.monotonic() - started < 10
    assert not result.ok and "did not finish within 0.5s; killed" in result.error
    assert _dies(int(pidfile.read_text())), "the tool's child survived"


def _dies(pid: int, deadline: float = 10.0) -> bool:
    """Whether the process is gone (or a zombie nobody reaped yet) within the deadline."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        stat_file = Path(f"/proc/{pid}/stat")
        if stat_file.exists() and stat_file.read_text().split()[2] == "Z":
            return True
        time.sleep(0.05)  # ok: polling for the child's death with a deadline
    return False


async def test_failures_say_why(tools_dir: Path) -> None:
    tool(tools_dir, "ibnetdiscover", "echo 'ibwarn: mad_rpc: _do_madrpc failed' >&2; exit 3")
    tools = FabricTools(str(tools_dir))
    result = await tools.run(m.Discover(request_id="r", tool=m.TOOL_IBNETDISCOVER))
    assert not result.ok and result.exit_code == 3 and "status 3: ibwarn: mad_rpc" in result.error
    result = await tools.run(m.Discover(request_id="r", tool="iblinkinfo"))
    assert not result.ok and "unknown tool" in result.error
    result = await tools.run(m.Discover(request_id="r", tool=m.TOOL_SMIR, device="mlx5_0; rm -rf /"))
    assert not result.ok and "not an RDMA device name" in result.error


async def test_output_past_the_cap_is_not_sent(tools_dir: Path) -> None:
    tool(tools_dir, "ibnetdiscover", "head -c 300000 /dev/urandom | od -x")
    result = await FabricTools(str(tools_dir), data_cap=1000).run(m.Discover(request_id="r", tool=m.TOOL_IBNETDISCOVER))
    assert (not result.ok and result.truncated and result.data == b""
            and "more than one message to the server carries" in result.error)


def test_the_cap_follows_the_smaller_message_limit(tools_dir: Path) -> None:
    tools = FabricTools(str(tools_dir))
    tools.fit(256 * 1024, 4 * 1024 * 1024)  # the server's is smaller
    assert tools.data_cap == (256 * 1024 - fabric_tools.ENVELOPE_ROOM) * 3 // 4
    assert tools.cap_note == "the server's fleet.max_message is 262,144 bytes"
    tools.fit(64 * 1024 * 1024, 0)  # a bigger limit never raises the configured cap
    assert tools.data_cap == fabric_tools.DATA_CAP and tools.cap_note == ""
    tools.fit(0, 1024 * 1024)  # an old server says nothing: this end's own limit still holds
    assert tools.data_cap == (1024 * 1024 - fabric_tools.ENVELOPE_ROOM) * 3 // 4


async def test_missing_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    result = await FabricTools(str(tmp_path)).run(m.Discover(request_id="r", tool=m.TOOL_SMIR))
    assert not result.ok and result.error == "saquery is not installed on this node"

"""The agent's side of `ctl fabric-test`, with real processes: perftest installed the first time with
the package manager /etc/os-release names (a stand-in `apt-get` on PATH, so nothing is installed),
the arguments perftest gets (RoCE: -x with the RoCE v2 GID index), a hung ib_write_bw killed with
its children at the timeout, the server side's readiness read from the kernel's socket table."""

from __future__ import annotations

import socket
import stat
import time
from pathlib import Path

import msgspec
import pytest

from llmgw.agent.fabric_test import (
    BIND_TRIES,
    FabricTester,
    free_port,
    install_command,
    listening,
    os_family,
)
from llmgw.catalog.schema import FabricTestSettings
from llmgw.fabric.perftest import parse
from llmgw.wire import messages as m
from tests.e2e.harness import make_sim_node, pid_alive

TABLE = (" #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
         " 65536      5000             392.38             392.34 \t\t     0.748336\n")


def script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


IB = m.Port(device="mlx5_0", port=1, link_layer="InfiniBand", rate_gbps=400.0)
ROCE = m.Port(device="mlx5_4", port=1, link_layer="Ethernet", rate_gbps=200.0, roce_v2_ipv4_gid_index=3)


def client(device: str = "mlx5_0", timeout: float = 30.0) -> m.FabricTest:
    return m.FabricTest(request_id="t1", role="client", device=device, server_host="10.0.0.2", server_port=18515,
                        timeout=timeout)


async def run(tester: FabricTester, req: m.FabricTest) -> list[msgspec.Struct]:
    sent: list[msgspec.Struct] = []
    await tester.run(req, sent.append)
    return sent


def test_os_release_names_the_package_manager() -> None:
    rocky = 'NAME="Rocky Linux"\nID="rocky"\nID_LIKE="rhel centos fedora"\n'
    which = {"apt-get": "/usr/bin/apt-get", "dnf": "/usr/bin/dnf"}.get
    assert os_family(rocky) == ["rocky", "rhel", "centos", "fedora"]
    assert install_command(rocky, which) == ["/usr/bin/dnf", "install", "-y", "perftest"]
    assert install_command("ID=pop\nID_LIKE='ubuntu debian'\n", which) == [
        "/usr/bin/apt-get", "install", "-y", "--no-install-recommends", "perftest"]
    assert install_command("ID=arch\n", which) is None
    assert install_command("ID=debian\n", lambda name: None) is None  # no apt-get on PATH: cannot install


def test_listening_reads_proc_net_tcp() -> None:
    text = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
            "   0: 00000000:4853 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1\n"
            "   1: 0100007F:1F90 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 2 1\n")
    assert listening(text, 0x4853) and not listening(text, 0x1F90) and not listening(text, 1)


async def test_missing_perftest_is_installed_with_apt_get_and_said(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "apt-get.args"
    # The stand-in apt-get "installs" an ib_write_bw that prints a table and its arguments.
    package = tmp_path / "package"
    package.mkdir()
    rows = "".join(f"echo '{line}'\n" for line in TABLE.splitlines())
    script(package / "ib_write_bw", f'echo "args: $*"\n{rows}')
    script(bin_dir / "apt-get", f'echo "$@" > {record}\n/bin/cp -p {package}/ib_write_bw {bin_dir}/ib_write_bw')
    os_release = tmp_path / "os-release"
    os_release.write_text('PRETTY_NAME="Debian GNU/Linux 12"\nID=debian\n')
    monkeypatch.setenv("PATH", str(bin_dir))
    tester = FabricTester(FabricTestSettings(install=True, os_release=str(os_release)), ports=lambda: [IB])
    # it can run one: it can install
    assert tester.path is None and tester.features == [m.FEATURE_FABRIC_TEST, m.FEATURE_FABRIC_TEST_DURATION]

    progress, done = await run(tester, client())
    assert isinstance(progress, m.FabricTestResult) and progress.phase == "progress"
    assert progress.notes == ["ib_write_bw missing: installing perftest with apt-get"]
    assert isinstance(done, m.FabricTestResult) and done.phase == "done" and done.ok, done
    assert record.read_text().split() == ["install", "-y", "--no-install-recommends", "perftest"]
    assert done.notes[0].startswith("installed perftest with apt-get (")
    assert parse(done.output).result is not None and parse(done.output).result.average == 392.34  # type: ignore[union-attr]
    assert "-d mlx5_0 -i 1 -p 18515 -s 65536 -n 5000 -F --report_gbits 10.0.0.2" in done.output
    # Installed once: the next test runs it directly.
    record.unlink()
    [again] = await run(tester, client())
    assert isinstance(again, m.FabricTestResult) and again.ok and not record.exists()


async def test_an_install_that_gives_no_ib_write_bw_fails_with_its_reason(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    script(tmp_path / "apt-get",
           'echo "E: Could not open lock file /var/lib/dpkg/lock-frontend - open (13: Permission denied)" '
           '>&2\nexit 100')
    (tmp_path / "os-release").write_text("ID=ubuntu\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    tester = FabricTester(FabricTestSettings(os_release=str(tmp_path / "os-release")), ports=lambda: [IB])
    _, done = await run(tester, client())
    assert isinstance(done, m.FabricTestResult) and not done.ok
    assert "installing perftest with apt-get did not give ib_write_bw (exit status 100: E: Could not open lock" in (
        done.error)


def test_without_ib_write_bw_or_an_installer_the_feature_is_not_advertised(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "os-release").write_text("ID=debian\n")
    assert FabricTester(FabricTestSettings(os_release=str(tmp_path / "os-release"))).features == []
    script(tmp_path / "apt-get", "exit 0")
    assert FabricTester(FabricTestSettings(install=False, os_release=str(tmp_path / "os-release"))).features == []
    assert FabricTester(FabricTestSettings(os_release=str(tmp_path / "os-release"))).features == [
        m.FEATURE_FABRIC_TEST, m.FEATURE_FABRIC_TEST_DURATION]


async def test_roce_gets_the_roce_v2_gid_index_and_a_port_without_one_is_refused(tmp_path: Path) -> None:
    script(tmp_path / "ib_write_bw", 'echo "args: $*"')
    tester = FabricTester(FabricTestSettings(install=False), str(tmp_path),
                          ports=lambda: [IB, ROCE, m.Port(device="mlx5_5", port=1, link_layer="Ethernet")])
    [done] = await run(tester, client("mlx5_4"))
    assert isinstance(done, m.FabricTestResult) and done.ok and done.gid_index == 3
    assert done.output.split()[-3:] == ["-x", "3", "10.0.0.2"] and done.notes == ["mlx5_4/1: RoCE v2 GID index 3"]
    [no_gid] = await run(tester, client("mlx5_5"))
    assert isinstance(no_gid, m.FabricTestResult) and "has no RoCE v2 GID with an IPv4 address" in no_gid.error
    [absent] = await run(tester, client("mlx5_9"))
    assert isinstance(absent, m.FabricTestResult) and absent.error == "this node has no RDMA port mlx5_9/1"
    [bad] = await run(tester, m.FabricTest(request_id="t", role="client", device="mlx5_0", server_host="-oProxy",
                                           server_port=1))
    assert isinstance(bad, m.FabricTestResult) and "not a host name" in bad.error
    [system] = await run(tester, m.FabricTest(request_id="t", role="client", device="mlx5_0", server_host="10.0.0.2",
                                              server_port=22))
    assert isinstance(system, m.FabricTestResult) and system.error == (
        "server port 22 is outside 1024-65535: not dialled")


async def test_a_duration_run_passes_D_and_gpudirect_use_cuda_only_where_the_gpu_exists(tmp_path: Path) -> None:
    """-D SECONDS instead of -n (perftest's duration mode), --use_cuda=N for GPUDirect; a GPU the node
    lacks, or a run longer than its timeout, is refused before perftest starts; the features say so."""
    script(tmp_path / "ib_write_bw", 'echo "args: $*"')
    gpus = [m.Gpu(index=0), m.Gpu(index=1)]
    tester = FabricTester(FabricTestSettings(install=False), str(tmp_path), ports=lambda: [IB], gpus=lambda: gpus)
    assert m.FEATURE_FABRIC_TEST_GPUDIRECT in tester.features
    req = m.FabricTest(request_id="t", role="client", device="mlx5_0", server_host="10.0.0.2", server_port=18515,
                       timeout=30, duration=5, cuda_device=1)
    [done] = await run(tester, req)
    assert isinstance(done, m.FabricTestResult) and done.ok, done.error
    args = done.output.split()
    assert args[args.index("-D") + 1] == "5" and "-n" not in args and "--use_cuda=1" in args, args
    [no_gpu] = await run(tester, msgspec.structs.replace(req, cuda_device=2))
    assert (isinstance(no_gpu, m.FabricTestResult)
            and "GPUDirect asked for GPU 2, and this node has GPUs 0, 1 only" in no_gpu.error)
    [too_long] = await run(tester, msgspec.structs.replace(req, duration=30))
    assert isinstance(too_long, m.FabricTestResult) and "does not fit in its 30 s timeout" in too_long.error
    bare = FabricTester(FabricTestSettings(install=False), str(tmp_path), ports=lambda: [IB])
    assert m.FEATURE_FABRIC_TEST_GPUDIRECT not in bare.features
    [refused] = await run(bare, msgspec.structs.replace(req, cuda_device=0))
    assert isinstance(refused, m.FabricTestResult) and "this node has no GPU" in refused.error
    [old] = await run(bare, msgspec.structs.replace(req, duration=0, cuda_device=-1))
    assert isinstance(old, m.FabricTestResult) and old.output.split()[old.output.split().index("-n") + 1] == "5000"


async def test_a_hung_ib_write_bw_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script(tmp_path / "ib_write_bw", f"sleep 300 &\necho $! > {pid_file}\nwait")
    tester = FabricTester(FabricTestSettings(install=False), str(tmp_path), ports=lambda: [IB])
    started = time.monotonic()
    # 4 s, not 1: under load a 1 s timeout could kill the shell before it had started its child
    # and written the pid file (seen twice in full unit runs at load 20).
    [done] = await run(tester, client(timeout=4.0))
    assert isinstance(done, m.FabricTestResult) and not done.ok
    assert done.error == "ib_write_bw did not finish within 4s; killed"
    assert time.monotonic() - started < 30
    assert not pid_alive(int(pid_file.read_text())), "the child outlived the kill"


async def test_the_server_side_says_ready_once_it_listens(tmp_path: Path) -> None:
    """A stand-in that listens on its -p port (as perftest does) and exits when a client connects."""
    import sys

    import trio

    server_py = tmp_path / "serve.py"
    server_py.write_text("import socket, sys\nport = int(sys.argv[sys.argv.index('-p') + 1])\n"
                         "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                         "s.bind(('127.0.0.1', port)); s.listen(1); c, _ = s.accept(); print('served', port)\n")
    script(tmp_path / "ib_write_bw", f'exec {sys.executable} {server_py} "$@"')
    tester = FabricTester(FabricTestSettings(install=False), str(tmp_path), ports=lambda: [IB])
    send, receive = trio.open_memory_channel[msgspec.Struct](4)
    req = m.FabricTest(request_id="s1", role="server", device="mlx5_0", timeout=30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tester.run, req, send.send_nowait)
        with trio.fail_after(30):
            ready = await receive.receive()
        assert isinstance(ready, m.FabricTestResult) and ready.phase == "ready" and ready.tcp_port > 0
        stream = await trio.open_tcp_stream("127.0.0.1", ready.tcp_port)
        await stream.aclose()
    done = receive.receive_nowait()
    assert isinstance(done, m.FabricTestResult) and done.phase == "done" and done.ok
    assert done.output.strip() == f"served {ready.tcp_port}"


async def test_prepare_only_makes_sure_ib_write_bw_is_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    (tmp_path / "os-release").write_text("ID=debian\n")
    script(tmp_path / "apt-get", f"/bin/cp -p {tmp_path / 'pkg'} {tmp_path / 'ib_write_bw'}")
    script(tmp_path / "pkg", "echo should-not-run; exit 1")
    tester = FabricTester(FabricTestSettings(os_release=str(tmp_path / "os-release")), ports=lambda: [IB])
    progress, done = await run(tester, m.FabricTest(request_id="p", role="prepare"))
    assert isinstance(done, m.FabricTestResult) and done.ok and done.output == "" and tester.path is not None
    assert isinstance(progress, m.FabricTestResult) and progress.phase == "progress"
    [again] = await run(tester, m.FabricTest(request_id="p2", role="prepare"))
    assert isinstance(again, m.FabricTestResult) and again.ok and not again.notes


def _proc_tree(root: Path, port: int, listeners: dict[int, int], stats: dict[int, int]) -> Path:
    """A /proc-like tree: net/tcp listing `listeners` (inode → pid) on `port` (and one other
    socket not listening), each pid's fd link to its socket, and `stats` (pid → process group)."""
    proc = root / "proc"
    (proc / "net").mkdir(parents=True)
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    rows = [f"   {i}: 00000000:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 00000000  "
            f"1000        0 {inode} 1"
            for i, inode in enumerate(listeners)]
    rows.append(f"   9: 0100007F:{port:04X} 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  "
                "1000        0 777 1")
    (proc / "net" / "tcp").write_text(head + "\n".join(rows) + "\n")
    for pid, pgrp in stats.items():
        (proc / str(pid) / "fd").mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (ib write) bw) S 1 {pgrp} {pgrp} 0 -1 4194560\n")
        (proc / str(pid) / "fd" / "0").symlink_to("/dev/null")
    for inode, pid in listeners.items():
        (proc / str(pid) / "fd" / str(3 + inode % 50)).symlink_to(f"socket:[{inode}]")
    (proc / str(next(iter(stats))) / "fd" / "9").symlink_to("socket:[777]")  # connected, not listening
    return proc


def test_a_listener_counts_only_if_its_socket_is_one_of_the_process_groups_files(tmp_path: Path) -> None:
    from llmgw.agent.fabric_test import ours_listening

    port = 0x4853
    # perftest itself (pid 100) listens.
    proc = _proc_tree(tmp_path / "a", port, {4242: 100}, {100: 100, 200: 200})
    assert ours_listening(port, 100, str(proc)) == (True, True)
    # A stranger (pid 200, its own group) listens on the port perftest was told: not ours.
    proc = _proc_tree(tmp_path / "b", port, {9999: 200}, {100: 100, 200: 200})
    assert ours_listening(port, 100, str(proc)) == (False, True)
    # A wrapper script's child (pid 101, in group 100) listens for it.
    proc = _proc_tree(tmp_path / "c", port, {4243: 101}, {100: 100, 101: 100, 200: 200})
    assert ours_listening(port, 100, str(proc)) == (True, True)
    # Nothing listens (the socket of pid 100 on that port is a connection, not a listener).
    proc = _proc_tree(tmp_path / "d", port, {}, {100: 100})
    assert ours_listening(port, 100, str(proc)) == (False, False)
    assert ours_listening(port, 100, str(tmp_path / "absent")) == (False, False)


class TakenFirst:
    """A stranger's listener on a port, and a pick_port that offers that port first (what the
    race between picking a free port and perftest binding it produces), then free ones."""

    def __init__(self) -> None:
        self.stranger = socket.create_server(("0.0.0.0", 0))
        self.stranger.setblocking(False)
        self.offered: list[int] = []

    def __call__(self) -> int:
        self.offered.append(free_port() if self.offered else self.stranger.getsockname()[1])
        return self.offered[-1]

    def nobody_came(self) -> bool:
        try:
            self.stranger.accept()[0].close()
        except BlockingIOError:
            return True
        return False


async def test_a_taken_port_is_retried_and_the_client_pairs_with_our_ib_write_bw(tmp_path: Path) -> None:
    """The stand-in ib_write_bw of `llmgw sim node`, as the agent runs it: the first port is
    another process's; perftest cannot bind it, exits saying so, and runs again on another
    port, which is the one reported ready; the client side meets it there (both print the table)."""
    import trio

    node = make_sim_node(tmp_path, "gpu-1", "http://127.0.0.1:1", "", "--ib-ports", "1").parent
    taken = TakenFirst()
    tools = str(node / "bin")
    server = FabricTester(FabricTestSettings(install=False), tools, ports=lambda: [IB], pick_port=taken)
    send, receive = trio.open_memory_channel[msgspec.Struct](4)
    req = m.FabricTest(request_id="s1", role="server", device="mlx5_0", timeout=60)
    with taken.stranger:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.run, req, send.send_nowait)
            with trio.fail_after(60):
                ready = await receive.receive()
            assert isinstance(ready, m.FabricTestResult) and ready.phase == "ready", ready
            assert ready.tcp_port == taken.offered[1] != taken.offered[0], (ready, taken.offered)
            assert ready.notes == [f"TCP port {taken.offered[0]} was taken before ib_write_bw could listen on it; "
                                   "trying another"]
            tester = FabricTester(FabricTestSettings(install=False), tools, ports=lambda: [IB])
            [mine] = await run(tester, m.FabricTest(request_id="c1", role="client", device="mlx5_0",
                                                    server_host="127.0.0.1",
                                                    server_port=ready.tcp_port, timeout=60))
        done = receive.receive_nowait()
        assert taken.nobody_came()
    assert isinstance(done, m.FabricTestResult) and done.phase == "done" and done.ok, done
    assert isinstance(mine, m.FabricTestResult) and mine.ok, mine
    assert parse(done.output).result is not None and parse(mine.output).result is not None, (done.output, mine.output)


async def test_a_strangers_listener_is_never_reported_ready(tmp_path: Path) -> None:
    """An ib_write_bw that never listens (it fails opening the device after a moment) on a port
    another process listens on: no "ready", only its failure; the retry is for bind failures alone."""
    script(tmp_path / "ib_write_bw", "sleep 1\necho \" Couldn't get context for the device\" >&2\nexit 1")
    taken = TakenFirst()
    tester = FabricTester(FabricTestSettings(install=False), str(tmp_path), ports=lambda: [IB], pick_port=taken)
    with taken.stranger:
        sent = await run(tester, m.FabricTest(request_id="s2", role="server", device="mlx5_0", timeout=30))
    [done] = sent
    assert isinstance(done, m.FabricTestResult) and done.phase == "done" and not done.ok
    assert done.error == "ib_write_bw exited with status 1: Couldn't get context for the device"
    assert taken.offered == taken.offered[:1] and done.notes == []


async def test_a_port_taken_every_time_gives_up_after_the_bound(tmp_path: Path) -> None:
    script(tmp_path / "ib_write_bw", 'echo "Couldn\'t listen to port 1" >&2\nexit 1')
    tester = FabricTester(FabricTestSettings(install=False), str(tmp_path), ports=lambda: [IB], pick_port=TakenFirst())
    [done] = await run(tester, m.FabricTest(request_id="s3", role="server", device="mlx5_0", timeout=30))
    assert isinstance(done, m.FabricTestResult) and not done.ok and len(done.notes) == BIND_TRIES
    assert done.error.startswith(f"ib_write_bw could not listen on any of {BIND_TRIES} free TCP ports (")

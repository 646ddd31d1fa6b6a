"""How a local gateway worker knows its server is gone (issue 41, finding 4): EOF on the pipe whose
write end only the server holds. A byte on it is not EOF; a closed write end is, however the
server ended. The fault suite kills a real server (tests/faults/test_gateway_workers_orphaned.py);
this is the watch alone, and the one line a wrong --parent-fd gets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
import trio.testing

from llmgw.errors import UsageError
from llmgw.server.gateway.run import parent_gone, run_gateway


async def test_the_watch_returns_at_eof_and_not_before() -> None:
    read, write = os.pipe()
    os.set_blocking(read, False)
    try:
        async with trio.open_nursery() as nursery:
            gone = trio.Event()

            async def watch() -> None:
                await parent_gone(read)
                gone.set()

            nursery.start_soon(watch)
            os.write(write, b"x")  # nothing writes on it, but a byte is not the server's end
            await trio.testing.wait_all_tasks_blocked()
            assert not gone.is_set()
            os.close(write)
            write = -1
            with trio.fail_after(5):
                await gone.wait()
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


async def test_a_parent_fd_that_is_no_pipe_is_one_line(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    try:
        with pytest.raises(UsageError, match=f"--parent-fd {fd} is not a pipe"):
            await run_gateway(control_plane=None, listen="127.0.0.1:0", cert=None, key=None, ca=None, name="",
                              insecure=False, worker=0, feed_socket=str(tmp_path / "gw.sock"), parent_fd=fd)
    finally:
        os.close(fd)

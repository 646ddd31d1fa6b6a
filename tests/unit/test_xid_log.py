"""Xids from before the agent started (issue 39): the kernel log's lines, in every shape they
reach an SRE, and the Xid watch seeded from them through the path the agent uses."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent import nvml_events, xid_log
from llmgw.agent.nvml_events import XID_WINDOW, XidWatch, read_kmsg
from llmgw.agent.xid_log import LoggedXid
from tests.unit.test_discovery import doctor_nvml

# Real lines, transcribed: journalctl (NVIDIA/open-gpu-kernel-modules#942, driver 580.82.07),
# syslog with dmesg's timestamp (a public pastebin, pastebin.com/NGng33SB, an older driver without
# "PCI:"), a bare NVRM line (stas00/ml-engineering, compute/accelerator/nvidia/debug.md) and the
# record /dev/kmsg hands out for such a line (prio,seq,usec,flags;message, Documentation/ABI/
# testing/dev-kmsg).
JOURNAL = "Oct 03 17:59:17 mnemosyne kernel: NVRM: Xid (PCI:0000:01:00): 62, 322bff9a 0000b3b8 00000000 206a4b08"
SYSLOG = (
    "Nov 22 18:29:55 hostname kernel: [  966.503025] NVRM: Xid (0000:01:00): 31, Ch 0000000b, engmask 00000120, intr "
    "10000000")
BARE = "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate."
KMSG = ("3,1534,6142305522,-;NVRM: Xid (PCI:0000:2a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the "
        "bus.\n")


def test_every_shape_of_the_line():
    assert xid_log.parse([JOURNAL, SYSLOG, BARE, KMSG, "6,1,2,-;usb 1-1: new device", ""]) == [
        LoggedXid(pci=(0, 0x01, 0x00), xid=62, at=None),
        LoggedXid(pci=(0, 0x01, 0x00), xid=31, at=966.503025),
        LoggedXid(pci=(0, 0x10, 0x1C), xid=63, at=None),
        LoggedXid(pci=(0, 0x2A, 0x00), xid=79, at=6142.305522),
    ]


def test_a_chunk_of_many_lines_is_read_line_by_line():
    assert [x.xid for x in xid_log.parse([f"{SYSLOG}\n{KMSG}"])] == [31, 79]


@given(st.lists(st.text(max_size=120), max_size=5))
def test_arbitrary_log_text_never_raises(lines):
    xid_log.parse(lines)


def test_the_watch_starts_with_the_xids_the_kernel_logged_within_the_window():
    boot = 7000.0  # seconds since boot when the agent starts; the kmsg record is at 6142.3 s
    older = f"6,9,{int((boot - XID_WINDOW - 5) * 1e6)},-;NVRM: Xid (PCI:0000:18:00): 48, pid=1, DBE\n"
    watch = XidWatch(clock=lambda: 100.0, kernel_log=lambda: [older, KMSG], since_boot=lambda: boot)
    nv = doctor_nvml([])  # GPUs on buses 0x18 and 0x2A
    assert watch.poll(nv) == {1: 79}  # GPU 0's Xid 48 is over an hour old
    assert watch.from_log == 1
    assert watch.last[1][1] == 100.0 - (boot - 6142.305522)


def test_no_kernel_log_no_seed_and_events_still_read():
    watch = XidWatch(kernel_log=lambda: None)
    assert watch.poll(doctor_nvml([SimpleNamespace(device=0, eventData=13)])) == {0: 13}
    assert watch.from_log == 0


def test_read_kmsg_refused_or_missing_is_none(tmp_path):
    assert read_kmsg(str(tmp_path / "no-kmsg")) is None
    log = tmp_path / "kmsg"
    log.write_text(KMSG)
    assert read_kmsg(str(log)) == [KMSG]  # a plain file reads in chunks; the parser splits lines
    assert nvml_events.KMSG_LIMIT >= 1024 * 1024

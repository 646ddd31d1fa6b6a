"""server/heap.py: a big refused message's freed C heap goes back to the OS (issue 41)."""

from __future__ import annotations

import platform

import pytest

from llmgw.server import heap


def test_only_a_big_message_is_worth_a_trim() -> None:
    assert heap.give_back(0) is False
    assert heap.give_back(heap.TRIM_AFTER - 1) is False


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_on_glibc_a_big_one_trims() -> None:
    assert heap.give_back(heap.TRIM_AFTER) is True

"""Programs from Debian's packages that some e2e tests drive (chromium, openssl).

`make test` installs each one that is missing with apt-get (CI starts on fresh machines), so a
machine with apt-get and without the program fails the test, never skips it: a skipped check
reads as a passed one. Only where apt-get does not exist (not Debian) is a missing one a skip.
"""

from __future__ import annotations

import shutil

import pytest


def debian_program(candidates: tuple[str, ...], package: str) -> str:
    """The path of the first of `candidates` on PATH; otherwise fail (or skip, without apt-get)."""
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    if shutil.which("apt-get"):
        pytest.fail(f"no {candidates[0]} on PATH: `make test` installs Debian's {package} package "
                    f"(apt-get install {package})")
    pytest.skip(f"no {candidates[0]} and no apt-get to install it (the test needs Debian's {package} package)")

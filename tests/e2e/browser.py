"""A real headless Chromium for the admin pages' tests, driven by Playwright's Python client.

The browser is Debian's `chromium` package (`make test` installs it when missing), launched
through `executable_path`: Playwright's own browser download is never used (CI reaches package
registries only). A machine with apt-get and no chromium fails the test, never skips it; only
where apt-get does not exist (not Debian) is a missing browser a skip.

One browser per test module; pages record console errors and uncaught exceptions, which each
test asserts are none.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CANDIDATES = ("chromium", "chromium-browser")


def chromium_path() -> str:
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    if shutil.which("apt-get"):
        pytest.fail("no chromium on PATH: `make test` installs Debian's chromium package (apt-get install chromium)")
    pytest.skip("no chromium and no apt-get to install it (the browser tests need Debian's chromium package)")


@contextmanager
def chromium() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    with sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where Chromium refuses its sandbox.
        browser = pw.chromium.launch(executable_path=path, headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            yield browser
        finally:
            browser.close()


class Watched:
    """A page and what went wrong on it: console errors and uncaught exceptions."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.errors: list[str] = []
        page.on("console", lambda msg: self.errors.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))

    def take_errors(self) -> list[str]:
        errors, self.errors = self.errors, []
        return errors

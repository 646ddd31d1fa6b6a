"""A real headless Chromium for the admin pages' tests, driven by Playwright's Python client.

The browser is Debian's `chromium` package (`make test` installs it when missing), launched
through `executable_path`: Playwright's own browser download is never used (CI reaches package
registries only). A machine with apt-get and no chromium fails the test, never skips it
(tests/e2e/needs.py).

One browser per test module; pages record console errors and uncaught exceptions, which each
test asserts are none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tests.e2e.needs import debian_program

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CANDIDATES = ("chromium", "chromium-browser")


def chromium_path() -> str:
    return debian_program(CANDIDATES, "chromium")


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
        page.on("console",
                lambda msg: self.errors.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))

    def take_errors(self) -> list[str]:
        errors, self.errors = self.errors, []
        return errors

"""Logging for the long-running commands: one line per event on stderr."""

from __future__ import annotations

import logging
import sys


def setup_logging(debug: bool = False, level: str | None = None) -> None:
    chosen = logging.DEBUG if debug else getattr(logging, (level or "INFO").upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(chosen)
    for noisy in ("hpack", "h2", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

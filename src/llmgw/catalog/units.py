"""Durations ("90s", "2m", "1h30m", 5) and byte sizes ("4MiB", "512k", 1024) in config files.

The types, their parsers and msgspec hooks live in llmgw.units, below both the catalog and the
gateway feed (llmgw.wire.gateway), which carries them too; here are the forms people type and read."""

from __future__ import annotations

from llmgw.units import ByteSize, Duration, dec_hook, enc_hook, parse_duration, parse_size

__all__ = ["ByteSize", "Duration", "dec_hook", "enc_hook", "format_duration", "parse_duration", "parse_since",
           "parse_size"]


def parse_since(text: str, now: float) -> float:
    """`--since` / `since=`: a duration back from now (90m, 2h, 1d), seconds back, or a time in
    seconds since the epoch (a number past 1e9) → the epoch time it names."""
    try:
        number = float(text)
    except ValueError:
        try:
            return now - float(parse_duration(text))
        except ValueError:
            raise ValueError(f"since={text!r}: expected a duration back from now (30m, 2h, 1d) or seconds since "
                             "the epoch") from None
    return number if number > 1e9 else now - number


def format_duration(seconds: float) -> str:
    """Short human form for tables: 4s, 3m12s, 2h05m, 3d4h."""
    if seconds < 0:
        seconds = 0
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 1 or seconds == 0 else f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours}h"

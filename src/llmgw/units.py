"""Durations ("90s", "2m", "1h30m", 5) and byte sizes ("4MiB", "512k", 1024): how config files
write them, and how the gateway feed carries them (as plain numbers, with these hooks).

Below both the catalog and the fleet protocol (wire), as llmgw/names.py is: the feed carries the
gateway's settings (llmgw.gwsettings), and neither floor imports the other (issue 42: wire/gateway
.py imported the catalog's units and schema). llmgw.catalog.units re-exports these and adds the
forms people type and read (--since, durations in tables).
"""

from __future__ import annotations

import json
import re

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
}  # fmt: skip


def _quote(value: object) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


class Duration(float):
    """Seconds. Parsed from a number or a string like "90s", "2m", "1h30m", "250ms"."""


class ByteSize(int):
    """Bytes. Parsed from an integer or a string like "4MiB", "512k", "1GB"."""


def parse_duration(value: object) -> Duration:
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 30s, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"expected a duration >= 0, got {value!r}")
        return Duration(value)
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        pos = 0
        total = 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
            pos = match.end()
        if text and pos == len(text):
            return Duration(total)
        try:
            seconds = float(text)
        except ValueError:
            pass
        else:
            if seconds >= 0:
                return Duration(seconds)
    raise ValueError(f"expected a duration like 30s, 2m or 1h30m, got {_quote(value)}")


def parse_size(value: object) -> ByteSize:
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 4MiB, got {value!r}")
    if isinstance(value, int) and value >= 0:
        return ByteSize(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return ByteSize(int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]))
    raise ValueError(f"expected a size like 4MiB or 512k, got {_quote(value)}")


def dec_hook(kind: type, obj: object) -> object:
    """msgspec hook: lets config Structs declare Duration and ByteSize fields."""
    if kind is Duration:
        return parse_duration(obj)
    if kind is ByteSize:
        return parse_size(obj)
    raise NotImplementedError(f"cannot convert to {kind}")


def enc_hook(obj: object) -> object:
    if isinstance(obj, Duration):
        return float(obj)
    if isinstance(obj, ByteSize):
        return int(obj)
    raise NotImplementedError(f"cannot encode {type(obj)}")

"""A weights download as `llmgw ctl replicas` shows it: one line under the replica (issue 12).

    ↓ model.safetensors  12.3 / 40.0 GB  31 %  850 MB/s  eta 33s   (eta as every duration ctl shows)
    ↓ model.safetensors  5.2 GB so far  640 MB/s

No percentage and no eta when the file server sent no length: the bytes are "so far".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment

from llmgw.catalog.units import format_duration
from llmgw.cli.render import text


def _name(source: str) -> str:
    path = source.split("?", 1)[0].split("#", 1)[0].rstrip("/")
    return path.rsplit("/", 1)[-1] or source


def _size(n: float, unit: tuple[float, str]) -> str:
    return f"{n / unit[0]:.1f}"


def _unit(n: float) -> tuple[float, str]:
    return (1e9, "GB") if n >= 1e9 else (1e6, "MB")


def _rate(bytes_per_s: float) -> str:
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.1f} GB/s"
    if bytes_per_s >= 1e6:
        return f"{bytes_per_s / 1e6:.0f} MB/s"
    return f"{bytes_per_s / 1e3:.0f} KB/s"


def progress_line(p: dict[str, Any]) -> str:
    done = int(p.get("bytes") or 0)
    total = p.get("total")
    rate = float(p.get("rate") or 0.0)
    parts = [f"↓ {_name(str(p.get('source', '')))}"]
    if total:
        unit = _unit(total)
        parts.append(f"{_size(done, unit)} / {_size(total, unit)} {unit[1]}")
        pct = int(done * 100 / total + 0.5)
        parts.append(f"{min(pct, 99) if done < total else 100} %")
        parts.append(_rate(rate))
        if rate > 0 and done < total:
            parts.append(f"eta {format_duration((total - done) / rate)}")
    else:
        unit = _unit(done)
        parts.append(f"{_size(done, unit)} {unit[1]} so far")
        parts.append(_rate(rate))
    return "  ".join(parts)


class LinesUnder:
    """A table whose empty rows are replaced, in order, by lines of text drawn across the whole
    width (a rich table has no cell spanning its columns)."""

    def __init__(self, table: RenderableType, lines: list[str]) -> None:
        self.table = table
        self.lines = lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[RenderableType | Segment]:
        pending = iter(self.lines)
        for line in console.render_lines(self.table, options, pad=False):
            if all(not seg.text.strip() for seg in line):
                under = next(pending, None)
                if under is not None:
                    yield text(under)
                    continue
            yield from line
            yield Segment.line()

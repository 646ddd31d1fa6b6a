"""A PCI function's link as sysfs prints it (`/sys/bus/pci/devices/*/current_link_speed`,
`current_link_width`, `max_link_speed`, `max_link_width`). Pure: text in, values out.

The kernel prints a speed as `pci_speed_string()` names it: "32.0 GT/s PCIe" since 5.x, "8 GT/s"
or "8.0 GT/s" before, "Unknown" (or "Unknown speed") where the link is down or a VF has none;
a width is a lane count ("16"), 0 or absent for a VF. Every transfer rate maps to one PCIe
generation (the PCI-SIG's: 2.5, 5, 8, 16, 32, 64 GT/s for Gen1-6).
"""

from __future__ import annotations

from collections.abc import Mapping

LINK_FILES = ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width")
GENERATIONS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


def parse_speed(text: str | None) -> float | None:
    """GT/s from `current_link_speed`; None for "Unknown", empty or unreadable."""
    word = (text or "").strip().split(" ", 1)[0]
    try:
        value = float(word)
    except ValueError:
        return None
    return value if value > 0 else None


def parse_width(text: str | None) -> int | None:
    word = (text or "").strip().lstrip("x")
    return int(word) if word.isdecimal() and int(word) > 0 else None


def generation(speed: float | None) -> int | None:
    """The PCIe generation of a transfer rate (8.0 GT/s → 3); None for a rate no generation has."""
    return GENERATIONS.get(speed) if speed is not None else None


def link(files: Mapping[str, str]) -> tuple[float | None, int | None, float | None, int | None]:
    """(speed, width, max speed, max width) from LINK_FILES' contents by name."""
    return (parse_speed(files.get("current_link_speed")), parse_width(files.get("current_link_width")),
            parse_speed(files.get("max_link_speed")), parse_width(files.get("max_link_width")))

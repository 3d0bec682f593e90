"""The `--link AXIS=LATENCY,BANDWIDTH` grammar: `parse_link` -> `AxisLink`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dpjax.errors import UserError

_LATENCY_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_BANDWIDTH_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
                    "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8,
                    "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z/]+)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class AxisLink:
    """The link every message crossing mesh axis `axis` travels over."""

    axis: str
    latency: float  # seconds per message
    bandwidth: float  # bytes per second

    def __str__(self) -> str:
        return f"{self.axis}={self.latency * 1e3:g}ms,{self.bandwidth * 8 / 1e6:g}mbit"


def parse_link(text: str) -> AxisLink:
    """'node=183ms,23mbit' -> AxisLink('node', 0.183, 2.875e6). Latency in s, ms or us;
    bandwidth in bit, kbit, mbit, gbit (or bps ... gbps: bits per second) or B/s ... GB/s.
    Raises UserError (one line) for anything else."""
    def bad(why):
        return UserError(f"bad --link {text!r}: {why}; write e.g. node=183ms,23mbit")

    axis, eq, rest = str(text).partition("=")
    parts = [p.strip() for p in rest.split(",")]
    if not eq or not axis.strip() or len(parts) != 2:
        raise bad("expected AXIS=LATENCY,BANDWIDTH")

    def value(part, units, what):
        m = _NUMBER_UNIT.match(part)
        if not m or m.group(2).lower() not in units:
            raise bad(f"{what} {part!r} needs a number and a unit ({', '.join(units)})")
        return float(m.group(1)) * units[m.group(2).lower()]

    latency = value(parts[0], _LATENCY_UNITS, "latency")
    bandwidth = value(parts[1], _BANDWIDTH_UNITS, "bandwidth")
    if bandwidth <= 0:
        raise bad("the bandwidth must be positive")
    return AxisLink(axis.strip(), latency, bandwidth)

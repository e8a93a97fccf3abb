"""Memory sizes as users write them ('24GiB', '512MB') and as the planner prints them."""
from __future__ import annotations

import re

GIB = 1024 ** 3
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1024 ** 2,
          "g": 1e9, "gb": 1e9, "gib": GIB, "t": 1e12, "tb": 1e12, "tib": 1024 ** 4}


def parse_bytes(text: str) -> int:
    """'24GiB', '24GB', '1.5 TiB', '123456' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r} (use e.g. 24GiB, 512MiB, 64GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(count: int) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB / 10 else f"{count / 1024 ** 2:.1f} MiB"

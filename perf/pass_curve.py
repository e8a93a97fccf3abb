"""The measured pass time: seconds per target pass as a function of the tokens it holds, from probed
(tokens, seconds) points, and its disk cache (one JSON file per key: model, plan, machine).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import warnings
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

CURVE_FORMAT, CURVE_VERSION = "pass-time-curve", 1


@dataclass(slots=True)
class PassTimeCurve:
    """Seconds per pass as a function of tokens in the pass, from measured (tokens, seconds) points."""
    points: list[tuple[float, float]]

    def __post_init__(self) -> None:
        self.points = sorted((float(n), float(s)) for n, s in self.points)
        if not self.points:
            raise ValueError("a pass-time curve needs at least one (tokens, seconds) point")
        sizes = [n for n, _ in self.points]
        if sizes[0] < 1 or len(set(sizes)) != len(sizes):
            raise ValueError(f"curve sizes must be distinct and >= 1, got {sizes}")
        if any(not math.isfinite(s) or s < 0 for _, s in self.points):
            raise ValueError(f"curve seconds must be finite and >= 0, got {[s for _, s in self.points]}")

    def seconds(self, n: float) -> float:
        """Piecewise-linear between points; the first value below the first point; beyond the last,
        the last segment's slope, never below the last value."""
        sizes = [size for size, _ in self.points]
        if n <= sizes[0]:
            return self.points[0][1]
        i = bisect_left(sizes, n)
        if i == len(sizes):
            if len(sizes) == 1:
                return self.points[-1][1]
            i -= 1
        (n0, s0), (n1, s1) = self.points[i - 1], self.points[i]
        value = s0 + (s1 - s0) * (n - n0) / (n1 - n0)
        return max(value, s1) if n > n1 else value

    def to_dict(self) -> dict:
        return {"format": CURVE_FORMAT, "version": CURVE_VERSION, "points": [list(p) for p in self.points]}

    @classmethod
    def from_dict(cls, data: dict) -> PassTimeCurve:
        if data.get("format") != CURVE_FORMAT or data.get("version") != CURVE_VERSION:
            raise ValueError(f"not a {CURVE_FORMAT} v{CURVE_VERSION}: format={data.get('format')!r}, "
                             f"version={data.get('version')!r}")
        return cls([(n, s) for n, s in data["points"]])


def curve_path(key: dict, folder: Path) -> Path:
    """The cache file for `key`: a hash of its canonical JSON, so any change of key misses."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return Path(folder) / f"pass-times-{digest[:24]}.json"


def load_curve(key: dict, folder: Path) -> PassTimeCurve | None:
    """The cached curve for `key`, or None when absent; a corrupt file warns and counts as absent."""
    path = curve_path(key, folder)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != json.loads(json.dumps(key)):
            raise ValueError("the stored key differs from the requested one")
        return PassTimeCurve.from_dict(data["curve"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        warnings.warn(f"ignoring unreadable pass-time cache {path}: {error}", RuntimeWarning, stacklevel=2)
        return None


def save_curve(key: dict, curve: PassTimeCurve, folder: Path) -> Path:
    """Writes the curve under `folder` atomically (temporary file, then os.replace); returns its path."""
    path = curve_path(key, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False)
    try:
        with handle:
            json.dump({"key": key, "curve": curve.to_dict()}, handle)
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    return path

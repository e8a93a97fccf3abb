"""What one pass through the streaming ring cost: its time, the waits, the loader's and decoder's time
and the bytes each tier moved (offload/stream.py fills it)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PassStats:
    num_tokens: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0        # compute thread blocked on a layer not yet loaded
    transfer_seconds: float = 0.0    # loader time spent moving the bytes consumed in this pass
    decode_seconds: float = 0.0      # decoder-thread time spent decoding them (decode_ahead)
    bytes_by_tier: dict[str, int] = field(default_factory=lambda: {"ram": 0, "disk": 0})

    @property
    def bytes_streamed(self) -> int:
        return sum(self.bytes_by_tier.values())

    @property
    def link_gbps(self) -> float:
        return self.bytes_streamed / self.transfer_seconds / 1e9 if self.transfer_seconds else 0.0

    def as_dict(self) -> dict:
        return {"num_tokens": self.num_tokens, "seconds": round(self.seconds, 5),
                "wait_seconds": round(self.wait_seconds, 5),
                "compute_seconds": round(self.seconds - self.wait_seconds, 5),
                "decode_seconds": round(self.decode_seconds, 5),
                "bytes_ram": self.bytes_by_tier["ram"], "bytes_disk": self.bytes_by_tier["disk"],
                "link_gbps": round(self.link_gbps, 3)}

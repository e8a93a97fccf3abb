"""What `serve` is configured with: where it listens and the limits that keep one client from stopping it."""
from __future__ import annotations

from dataclasses import dataclass

LOCALHOST = "127.0.0.1"


@dataclass(slots=True)
class ServeConfig:
    host: str = LOCALHOST           # only this machine, unless --host says otherwise
    port: int = 8000
    api_key: str | None = None      # None: no key asked
    max_new_tokens: int = 1024      # the most one answer may ask for, and what a request that names none gets
    max_body_bytes: int = 1 << 20   # a larger request body is refused (413) before it is parsed
    max_queue: int = 32             # requests waiting for a slot; one more is refused (429)
    max_connections: int = 64       # open HTTP connections and tasks (uvicorn's limit_concurrency; then 503)
    quiet: bool = False             # uvicorn logs warnings only (tests, benchmarks)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must lie in [0, 65535], got {self.port}")
        for name, flag in (("max_new_tokens", "--max-new-tokens"), ("max_body_bytes", "--max-body"),
                           ("max_connections", "--max-connections")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be positive, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

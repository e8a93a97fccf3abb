"""server/: `serve`, an OpenAI-compatible HTTP server: the engine worker that owns the decoder (worker.py),
the request checks (schemas.py), the starlette app (app.py) and uvicorn running it (run.py)."""
from .config import ServeConfig
from .run import SpecstreamServer

__all__ = ["ServeConfig", "SpecstreamServer"]

"""`serve` running: the engine worker's thread and uvicorn serving the app. SIGINT / SIGTERM stop it cleanly:
every waiting and running request ends (a stream with an error chunk, a waiting response with a 503), uvicorn
closes its connections, and run() returns (the process exits 0, not by the signal)."""
from __future__ import annotations

import signal
import threading
import time

import uvicorn

from runtime import Session
from runtime.sampling_defaults import SamplingDefaults
from .app import Served, build_app
from .config import ServeConfig
from .worker import EngineWorker

GRACEFUL_SHUTDOWN_SECONDS = 10      # then uvicorn drops what is still open


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, whose signal handler also stops the engine worker; the signal is not raised again
    after the server exits (uvicorn does, which would end the process by SIGTERM instead of exit 0)."""

    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame) -> None:
        self.on_exit(f"the server is shutting down ({signal.Signals(sig).name})")
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True          # a second Ctrl-C
        self.should_exit = True


class SpecstreamServer:
    def __init__(self, session: Session, config: ServeConfig, defaults: SamplingDefaults | None = None,
                 explicit: dict | None = None, default_stop: list[str] | None = None) -> None:
        self.config = config
        self.worker = EngineWorker(session.decoder, session.tokenizer, config.max_queue)
        self.served = Served(self.worker, session.tokenizer, session.model_name, session.config.max_context,
                             session.target.config.vocab_size, config, defaults or SamplingDefaults({}),
                             dict(explicit or {}), list(default_stop or []))
        uvicorn_config = uvicorn.Config(build_app(self.served), host=config.host, port=config.port,
                                        limit_concurrency=config.max_connections,
                                        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
                                        log_level="warning" if config.quiet else "info",
                                        access_log=not config.quiet)
        self.uvicorn = _Uvicorn(uvicorn_config, self.worker.stop)

    def run(self) -> None:
        """Serves until a signal (in the main thread) or stop(); the worker has stopped when this returns."""
        self.worker.start()
        try:
            self.uvicorn.run()
        finally:
            self.worker.stop("the server is shutting down")
            self.worker.join()

    def start_in_thread(self, timeout: float = 30) -> threading.Thread:
        """run() in a thread (no signal handlers there), returning once it accepts connections."""
        thread = threading.Thread(target=self.run, name="specstream-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.uvicorn.started:
            raise RuntimeError(f"the server did not start on {self.config.host}:{self.config.port}")
        return thread

    @property
    def port(self) -> int:
        """The port bound (the configured one, or the one the system chose for port 0)."""
        return self.uvicorn.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.uvicorn.handle_exit(signal.SIGTERM, None)

"""runtime/: what the CLI drives: a loaded session (target, decoder, stats) and resumable batch jobs."""
from .batch import BatchItem, BatchSummary, run_batch
from .session import RuntimeConfig, Session, UserError

__all__ = ["BatchItem", "BatchSummary", "run_batch", "RuntimeConfig", "Session", "UserError"]

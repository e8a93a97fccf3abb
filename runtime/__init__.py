"""runtime/: the session (target + draft + decoder + reports: the composition root), batch jobs, and the
wiring of budget, draft and judge policies."""
from .batch import BatchItem, BatchSummary, run_batch
from .models import load_model, weight_formats, with_formats
from .session import RuntimeConfig, Session, UserError

__all__ = ["BatchItem", "BatchSummary", "run_batch", "load_model", "weight_formats", "with_formats",
           "RuntimeConfig", "Session", "UserError"]

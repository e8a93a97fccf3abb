"""runtime/: what the CLI drives: a loaded session (target, draft, decoder, stats), resumable batch jobs,
tool commands. Importing it registers the packed weight formats with the engine (quant/'s SpQR)."""
from offload.formats import register_format
from quant.checkpoint import SpqrFormat

register_format(SpqrFormat())

from .batch import BatchItem, BatchSummary, run_batch  # noqa: E402
from .session import RuntimeConfig, Session, UserError  # noqa: E402

__all__ = ["BatchItem", "BatchSummary", "run_batch", "RuntimeConfig", "Session", "UserError"]

"""spec/distill/: drafts for any target: distillation, the draft folder format, loading, benchmarking."""
from .answer_cache import AnswerCache
from .bench import DraftBenchConfig, bench_draft
from .compat import check_tokenizers_match
from .distill import DistillConfig, distill
from .draft_io import DraftFormatError, is_draft_folder, load_draft_module, read_draft_info
from .draft_runtime import default_draft_for, load_draft
from .generate import GenerationConfig

__all__ = ["AnswerCache", "DraftBenchConfig", "bench_draft", "check_tokenizers_match", "DistillConfig", "distill",
           "DraftFormatError", "is_draft_folder", "load_draft_module", "read_draft_info", "default_draft_for",
           "load_draft", "GenerationConfig"]

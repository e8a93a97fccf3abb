"""spec/distill/: training drafts for any target: distillation, writing the draft folder, benchmarking."""
from .answer_cache import AnswerCache
from .bench import DraftBenchConfig, bench_draft
from .distill import DistillConfig, distill
from .draft_io import load_draft_module
from .generate import GenerationConfig

__all__ = ["AnswerCache", "DraftBenchConfig", "bench_draft", "DistillConfig", "distill", "load_draft_module",
           "GenerationConfig"]

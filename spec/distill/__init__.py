"""spec/distill/: training drafts for any target: distillation, writing the draft folder."""
from .answer_cache import AnswerCache
from .distill import DistillConfig, distill
from .draft_io import load_draft_module
from .generate import GenerationConfig

__all__ = ["AnswerCache", "DistillConfig", "distill", "load_draft_module",
           "GenerationConfig"]

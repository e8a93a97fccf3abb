"""spec/: sampling, trees, drafting, verification and the decoding loop."""
from .decoding import BudgetPolicy, DecodeConfig, Decoder, DecodeResult, FixedBudget, StopCondition
from .draft import Draft, default_draft_for, load_any_draft, load_draft
from .grow import GrowthConfig, TreeGrower
from .sampling import SamplingConfig, probabilities, sample
from .speculator import Speculator
from .stats import DecodeStats
from .tree import Tree
from .verify import AcceptancePolicy, ExactMatch, Verdict, accepted_path

__all__ = ["BudgetPolicy", "DecodeConfig", "Decoder", "DecodeResult", "FixedBudget", "StopCondition", "Draft", "default_draft_for",
           "load_any_draft", "load_draft", "GrowthConfig", "TreeGrower", "SamplingConfig", "probabilities", "sample",
           "Speculator", "DecodeStats", "Tree", "AcceptancePolicy", "ExactMatch", "Verdict", "accepted_path"]

"""spec/: sampling, trees, drafting, verification and the decode loop (one sequence or many)."""
from .decoding import Decoder
from .draft import Draft, default_draft_for, load_any_draft, load_draft
from .grow import GrowthConfig
from .requests import (BudgetPolicy, DecodeConfig, DecodeRequest, DecodeResult, FixedBudget, FixedTree,
                       StopCondition)
from .sampling import SamplingConfig, probabilities, sample
from .speculator import Proposal, Speculator
from .stats import DecodeStats
from .tree import Tree
from .verify import AcceptancePolicy, ExactMatch, Verdict, accepted_path

__all__ = ["BudgetPolicy", "DecodeConfig", "DecodeRequest", "Decoder", "DecodeResult", "FixedBudget", "FixedTree",
           "StopCondition", "Draft", "default_draft_for", "load_any_draft", "load_draft", "GrowthConfig",
           "SamplingConfig", "probabilities", "sample", "Proposal", "Speculator", "DecodeStats", "Tree",
           "AcceptancePolicy", "ExactMatch", "Verdict", "accepted_path"]

"""perf/: the performance model. How long a target pass takes, how large each speculation tree should be,
and the rate that results, before a run (`plan`) and during one (`--budget auto`, `--batch-size auto`).
Where weights live and how they move is offload/ (placement); perf/ only predicts and measures.

Vocabulary, one meaning each:
    tree size, tree budget   tokens in one speculation tree (the `--budget` flag); `budget` alone means this here
    memory limit             bytes a tier may hold (offload/memory_limits.py gives the defaults)
    pass time                seconds per target pass, a function of the tokens the pass holds
    rate                     tokens per second

Files:
    pass_model.py       predicted pass time from a GPU preset or a measured device check (MeasuredPassCurve)
    pass_curve.py       PassTimeCurve: the pass time probed on this machine, and its disk cache
    probe.py            probing a loaded target (once per model, plan and machine); the throughput batch
    tree_size.py        the tree budget's range and BudgetChooser, which picks each step's tree size
    projection.py       acceptance curves, draft cost and the projected rate per tree budget
    plan_request.py     the plan request for a weight format from config.json or a GGUF header
    plan_projection.py  what `plan` projects for a plan on a described GPU
    self_draft_plan.py  what `plan --draft self` reports: substitutes at each width against the device memory
    self_draft_cost.py  a self-draft's step on a GPU (a whole-model forward that streams nothing)
    llama_cpp_offload.py llama.cpp's partial offload on the same card and RAM, the peer `plan --draft self` names
"""
from .pass_curve import PassTimeCurve
from .pass_model import GPU_PRESETS, GpuPreset, MeasuredPassCurve, PassModelInputs, gpu_preset, predicted_pass_seconds
from .projection import AcceptanceCurve, DraftCost, Projection, default_acceptance_curve, project
from .tree_size import MAX_BUDGET, MIN_BUDGET, BudgetChooser, check_budget, parse_budget

__all__ = ["PassTimeCurve", "GPU_PRESETS", "GpuPreset", "MeasuredPassCurve", "PassModelInputs", "gpu_preset",
           "predicted_pass_seconds", "AcceptanceCurve", "DraftCost", "Projection", "default_acceptance_curve",
           "project", "MAX_BUDGET", "MIN_BUDGET", "BudgetChooser", "check_budget", "parse_budget"]

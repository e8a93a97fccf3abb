"""The default model streamed from RAM and from disk gives the resident run's tokens, within budget."""
import pytest

from runtime import RuntimeConfig, Session
from spec import SamplingConfig

pytestmark = pytest.mark.e2e
MiB = 2 ** 20
PROMPT = [{"role": "user", "content": "Name three primary colors."}]


def _run(**budgets):
    session = Session(RuntimeConfig(device="cpu", dtype="fp32", max_context=512, cpu_kernel="dense",  # fp32 budgets
                                    **budgets))
    try:
        text, result = session.generate(session.encode(PROMPT), SamplingConfig(), 24)
        return result.token_ids, session.report(text, result)
    finally:
        session.close()


def test_resident_ram_and_disk_runs_are_token_identical_within_budget():
    resident_ids, resident = _run()
    assert resident["engine"]["layers"] == {"device": 30, "ram": 0, "disk": 0} and resident["bytes_streamed"] == 0
    budget = 600 * MiB
    for tier, ram in (("ram", None), ("disk", 1)):
        ids, report = _run(gpu_mem=budget, ram=ram)
        layers = report["engine"]["layers"]
        assert layers[tier] > 10 and layers["device"] + layers[tier] == 30
        assert ids == resident_ids, tier
        assert report["peak_device_bytes"] <= budget
        per_pass = layers[tier] * report["engine"]["layer_bytes"]
        assert report["bytes_streamed"] == per_pass * report["num_target_passes"] > 0

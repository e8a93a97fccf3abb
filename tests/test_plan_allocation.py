"""The plan counts what the session allocates: every persistent device item of the plan (globals, the draft and
its KV cache, the target's KV cache slots, resident layers and ring buffers) equals the bytes the loaded session
holds, for one sequence and a batch of eight, resident and streamed (the embedded default pair on the CPU, where
the engine accounts for its own memory)."""
import pytest

from offload.byte_units import parse_bytes
from runtime.session import RuntimeConfig, Session

pytestmark = pytest.mark.e2e


def _item(plan, prefix: str) -> int:
    [item] = [i for i in plan.items if i.component.startswith(prefix) and i.tier == "device"]
    return item.num_bytes


@pytest.mark.parametrize("batch_size, gpu_mem", [(1, None), (8, None), (1, "700MiB"), (8, "2800MiB")])
def test_the_plans_device_items_are_the_bytes_allocated(batch_size, gpu_mem):
    config = RuntimeConfig(batch_size=batch_size, budget=16, gpu_mem=parse_bytes(gpu_mem) if gpu_mem else None,
                           cpu_kernel="dense")     # budgets sized for fp32 layers (the packed plan: test_packed_cpu.py)
    with Session(config) as session:
        plan, decoder = session.target.plan, session.decoder
        streams = any(tier != "device" for tier in plan.tier_of)
        assert streams == (gpu_mem is not None) and decoder.cache.num_seq_slots == batch_size
        assert _item(plan, "embeddings, final norm, LM head") == session.target.global_bytes
        assert _item(plan, "KV cache") == decoder.cache.num_bytes
        assert _item(plan, "draft KV cache") == decoder.speculator.cache.num_bytes
        assert _item(plan, "draft model") == session.draft.device_bytes
        layers = sum(i.num_bytes for i in plan.items if i.tier == "device" and i.component.startswith(("decoder", "ring")))
        assert layers == session.target.layers.device_bytes > 0
        persistent = sum(i.num_bytes for i in plan.items if i.tier == "device" and "workspace" not in i.component)
        assert session.peak_device_bytes() == persistent

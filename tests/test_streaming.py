"""The streaming engine on tiny random models: tiers give identical results, budgets hold,
stats count the bytes, and faults (read errors, Ctrl-C) end cleanly."""
import threading
import time

import pytest
import torch

import offload.model.layers
import offload.model.decoder
from offload.loader import LoadOptions, build_engine
from offload.planner import PlanError
from offload.stream import StreamError
from offload.weights.source import CheckpointSource


def _engine(folder, tier: str, ring_size: int = 2, num_resident: int = 1, **kwargs):
    """Budgets chosen from a first all-resident plan so that `tier` is forced."""
    probe = build_engine(CheckpointSource(folder), LoadOptions(device="cpu", dtype="fp32", max_context=64,
                                                              max_pass_tokens=16))
    fixed = sum(i.num_bytes for i in probe.plan.items if "layers" not in i.component)
    layer_bytes = probe.plan.request.layer_bytes
    probe.layers.close()
    if tier == "device":
        gpu_mem, ram = fixed + 100 * layer_bytes, None
    else:
        gpu_mem = fixed + (ring_size + num_resident) * layer_bytes
        ram = 1 if tier == "disk" else 100 * layer_bytes
    options = LoadOptions(device="cpu", dtype="fp32", max_context=64, max_pass_tokens=16, gpu_mem=gpu_mem,
                          ram=ram, ring_size=ring_size, **kwargs)
    return build_engine(CheckpointSource(folder), options), gpu_mem


def _greedy(model, prompt, steps=12):
    cache = model.new_cache(64)
    out = model.forward(torch.tensor([prompt]), cache, last_only=True)
    cache.commit()
    tokens = []
    for _ in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model.forward(torch.tensor([[tokens[-1]]]), cache)
        cache.commit()
    return tokens, out.logits


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from conftest import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("stream"), "llama", num_hidden_layers=6)[0]


@pytest.mark.parametrize("ring_size", [1, 2, 3])
def test_ram_and_disk_streaming_match_resident_exactly(folder, ring_size):
    prompt = [5, 17, 99, 3, 42]
    resident, _ = _engine(folder, "device")
    expected_tokens, expected_logits = _greedy(resident.model, prompt)
    assert resident.plan.tier_of == ["device"] * 6
    for tier in ("ram", "disk"):
        engine, budget = _engine(folder, tier, ring_size)
        assert engine.plan.tier_of == ["device"] + [tier] * 5
        tokens, logits = _greedy(engine.model, prompt)
        engine.layers.close()
        assert tokens == expected_tokens
        assert torch.equal(logits, expected_logits)
        assert engine.global_bytes + engine.layers.device_bytes <= budget


def test_pass_stats_count_streamed_bytes(folder):
    engine, _ = _engine(folder, "ram")
    cache = engine.model.new_cache(64)
    engine.model.forward(torch.tensor([[1, 2, 3]]), cache)
    stats = engine.layers.last_pass
    engine.layers.close()
    assert stats.num_tokens == 3
    assert stats.bytes_by_tier == {"ram": 5 * engine.layers.layout.num_bytes, "disk": 0}
    assert 0 <= stats.wait_seconds <= stats.seconds


def test_ring_wraps_into_the_next_pass(folder):
    engine, _ = _engine(folder, "ram", ring_size=2)
    cache = engine.model.new_cache(64)
    engine.model.forward(torch.tensor([[1, 2, 3]]), cache)
    deadline = time.time() + 5
    while time.time() < deadline and [s.state for s in engine.layers.slots] != ["ready", "ready"]:
        time.sleep(0.01)
    # streamed layers 1..5; loads 5 and 6 (the next pass's layers 1 and 2) go to slots 1 and 0
    assert [s.layer for s in engine.layers.slots] == [2, 1]
    assert [s.state for s in engine.layers.slots] == ["ready", "ready"]
    engine.layers.close()


def test_wait_filled_is_false_with_no_loader_and_true_once_the_ring_is_full(folder):
    engine, _ = _engine(folder, "ram", ring_size=2)
    assert not engine.layers.wait_filled(0.3)      # no pass yet: no loader, nothing will fill the slots
    engine.model.forward(torch.tensor([[1, 2, 3]]), engine.model.new_cache(64))
    assert engine.layers.wait_filled(5)
    assert [s.state for s in engine.layers.slots] == ["ready", "ready"]
    engine.layers.close()
    resident, _ = _engine(folder, "device")
    assert not resident.layers.streamed and resident.layers.wait_filled(0.3)   # nothing streams: nothing to wait for
    resident.layers.close()


@pytest.mark.parametrize("ring_size", [2, 3, 4])
def test_two_loaders_filling_the_ring_out_of_order_still_match_resident(folder, ring_size, monkeypatch):
    import offload.stream
    prompt = [5, 17, 99, 3, 42]
    resident, _ = _engine(folder, "device")
    expected_tokens, expected_logits = _greedy(resident.model, prompt)
    real_copy = offload.stream.copy_host

    def lagging_first_loader(target, source):   # loader 1's layers land before loader 0's
        if threading.current_thread().name == "layer-loader-0":
            time.sleep(0.003)
        real_copy(target, source)

    monkeypatch.setattr(offload.stream, "copy_host", lagging_first_loader)
    engine, _ = _engine(folder, "ram", ring_size, loaders=2)
    assert len(engine.layers.streamed) > ring_size and engine.layers.num_loaders == 2
    tokens, logits = _greedy(engine.model, prompt)
    assert engine.layers.wait_filled(5)            # after a pass both loaders read ahead, then every slot is full
    assert all(slot.state == "ready" for slot in engine.layers.slots)
    engine.layers.close()
    assert tokens == expected_tokens
    assert torch.equal(logits, expected_logits)


def test_a_lagging_loader_keeps_its_slot_from_the_loader_ahead(folder, monkeypatch):
    """Ring of 3, 2 loaders: slot 0 holds uses 0, 3, 6, ... of which loader 1 loads 3. Loader 1 is made slow to
    claim, so loader 0 reaches use 6 while slot 0 waits for use 3: it must not take the slot (a hang)."""
    import offload.stream
    real_claim = offload.stream.StreamingLayers._claim

    def lagging_claim(self, *args, **kwargs):
        if threading.current_thread().name == "layer-loader-1":
            time.sleep(0.02)
        return real_claim(self, *args, **kwargs)

    resident, _ = _engine(folder, "device")
    expected, _ = _greedy(resident.model, [5, 17, 99], steps=4)
    monkeypatch.setattr(offload.stream.StreamingLayers, "_claim", lagging_claim)
    engine, _ = _engine(folder, "ram", 3, loaders=2)
    result = {}
    worker = threading.Thread(target=lambda: result.update(tokens=_greedy(engine.model, [5, 17, 99], steps=4)[0]),
                              daemon=True)
    worker.start()
    worker.join(20)
    hung = worker.is_alive()
    engine.layers.close()
    assert not hung and result["tokens"] == expected


def test_loads_through_a_shared_buffer_keep_one_loader(folder):
    buffered, _ = _engine(folder, "disk", 3, direct_reads=False)       # reads scatter through one scratch buffer
    assert buffered.layers.num_loaders == 1
    buffered.layers.close()
    one, _ = _engine(folder, "ram", 3, loaders=1)
    assert one.layers.num_loaders == 1
    one.layers.close()
    with pytest.raises(ValueError, match="loaders must be >= 1"):
        LoadOptions(loaders=0)


def _loader_threads():
    return [t for t in threading.enumerate() if t.name.startswith(("layer-loader", "layer-decoder"))]


@pytest.mark.parametrize("ring_size", [1, 3])     # one loader; two (on a file system with O_DIRECT)
def test_read_error_mid_pass_raises_clearly_and_never_hangs(folder, monkeypatch, ring_size):
    import errno

    import offload.disk_reads
    engine, _ = _engine(folder, "disk", ring_size=ring_size)
    real_preadv, calls = offload.disk_reads.os.preadv, {"n": 0}

    def failing_preadv(*args):   # the disk goes bad a few reads into the pass (one read per layer)
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(*args)

    monkeypatch.setattr(offload.disk_reads.os, "preadv", failing_preadv)
    start = time.time()
    with pytest.raises(StreamError, match=r"decoder layer \d+ from disk"):
        engine.model.forward(torch.tensor([[1, 2]]), engine.model.new_cache(64))
    assert time.time() - start < 10
    assert not _loader_threads()


def test_ctrl_c_mid_pass_stops_the_loader_and_the_next_pass_still_works(folder, monkeypatch):
    engine, _ = _engine(folder, "ram")
    prompt = torch.tensor([[4, 8, 15]])
    expected = engine.model.forward(prompt, engine.model.new_cache(64)).logits
    real_layer, calls = offload.model.decoder.decoder_layer, {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_layer(*args, **kwargs)

    monkeypatch.setattr(offload.model.decoder, "decoder_layer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.model.forward(prompt, engine.model.new_cache(64))
    assert not _loader_threads()
    monkeypatch.setattr(offload.model.decoder, "decoder_layer", real_layer)
    again = engine.model.forward(prompt, engine.model.new_cache(64)).logits
    engine.layers.close()
    assert torch.equal(again, expected)
    assert offload.model.layers.decoder_layer is real_layer


def test_budget_below_ring_minimum_is_refused(folder):
    with pytest.raises(PlanError, match="too small"):
        build_engine(CheckpointSource(folder), LoadOptions(device="cpu", max_context=64, max_pass_tokens=16,
                                                           gpu_mem=1000))


def test_on_a_cpu_a_decoder_thread_decodes_and_prepares_streamed_layers_ahead(folder):
    prompt = [5, 17, 99, 3, 42]
    resident, _ = _engine(folder, "device")
    expected_tokens, expected_logits = _greedy(resident.model, prompt)
    engine, _ = _engine(folder, "disk", decode_ahead=True)
    layers, inner, decoded = engine.layers, engine.layers.decode, []
    assert layers.decode_ahead and not _engine(folder, "disk")[0].layers.decode_ahead      # off by default

    class Packed:       # stands for a packed weight: prepare() is where it would dequantize
        prepared_in = None

        def prepare(self):
            self.prepared_in = threading.current_thread().name

    def decode(index, stored):
        decoded.append((index, threading.current_thread().name, Packed()))
        return {**inner(index, stored), "packed": decoded[-1][2]}

    layers.decode = decode
    tokens, logits = _greedy(engine.model, prompt)
    layers.close()
    assert tokens == expected_tokens and torch.equal(logits, expected_logits)
    streamed = [(index, packed) for index, thread, packed in decoded if thread == "layer-decoder"]
    assert {index for index, _ in streamed} == {1, 2, 3, 4, 5}
    assert all(packed.prepared_in == "layer-decoder" for _, packed in streamed)
    assert {index for index, thread, _ in decoded if thread != "layer-decoder"} == {0}      # the resident layer
    assert not _loader_threads()
    assert layers.total.decode_seconds > 0


def test_a_decode_error_in_the_decoder_thread_raises_clearly_and_never_hangs(folder):
    engine, _ = _engine(folder, "ram", decode_ahead=True)
    inner = engine.layers.decode

    def failing(index, stored):
        if index == 3:
            raise ValueError("layer 3: truncated packed data")
        return inner(index, stored)

    engine.layers.decode = failing
    start = time.time()
    with pytest.raises(StreamError, match="truncated packed data"):
        engine.model.forward(torch.tensor([[1, 2]]), engine.model.new_cache(64))
    assert time.time() - start < 10
    assert not _loader_threads()

"""Layer reads in file runs: the buffered (one preadv per run) and O_DIRECT (aligned chunks through a bounce
buffer) readers land every tensor's exact bytes, against the file's own bytes; the disk tier reads a
checkpoint's layers equal to its memory map either way."""
import errno
import os

import numpy as np
import pytest
import torch

import offload.disk_reads
from offload.disk_reads import BufferedReader, DirectReader, plan_runs
from offload.host_io import aligned_host
from offload.tiers import DiskTier
from offload.weights.source import CheckpointSource


def test_runs_merge_nearby_tensors_of_a_file_and_split_across_files_and_large_gaps(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    spans = {"q": (a, 100, 50), "k": (a, 160, 40), "v": (a, 5000, 10), "o": (b, 0, 8), "up": (a, 0, 100)}
    runs = plan_runs(spans, max_gap=1000)
    assert [(run.path, run.start, run.end, [p.name for p in run.pieces]) for run in runs] == [
        (a, 0, 200, ["up", "q", "k"]), (a, 5000, 5010, ["v"]), (b, 0, 8, ["o"])]


def _file_and_runs(tmp_path, size=50_000, seed=0):
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    path.write_bytes(data.tobytes())
    # unaligned tensors with gaps, one crossing every 4096-byte boundary in its way
    spans = {"t0": (path, 3, 5000), "t1": (path, 5007, 1), "t2": (path, 6000, 30_000), "t3": (path, 36_001, 13_999)}
    return data, spans, plan_runs(spans, max_gap=2000)


@pytest.mark.parametrize("reader", ["buffered", "direct", "direct-small-chunks"])
def test_each_reader_lands_every_tensors_exact_bytes(tmp_path, reader):
    data, spans, runs = _file_and_runs(tmp_path)
    if reader != "buffered" and not DirectReader.supported(runs[0].path):
        pytest.skip("this file system refuses O_DIRECT")
    chosen = {"buffered": BufferedReader, "direct": DirectReader,
              "direct-small-chunks": lambda: DirectReader(bounce_bytes=8192)}[reader]()
    targets = {name: np.zeros(n, dtype=np.uint8) for name, (_, _, n) in spans.items()}
    for run in runs:
        chosen.read(run, targets)
    chosen.close()
    for name, (_, start, n) in spans.items():
        assert np.array_equal(targets[name], data[start:start + n]), name


@pytest.mark.parametrize("reader", [BufferedReader, DirectReader])
def test_a_file_shorter_than_its_run_is_an_error_naming_it(tmp_path, reader):
    data, spans, runs = _file_and_runs(tmp_path)
    if reader is DirectReader and not DirectReader.supported(runs[0].path):
        pytest.skip("this file system refuses O_DIRECT")
    runs[0].path.write_bytes(data[:20_000].tobytes())
    targets = {name: np.zeros(n, dtype=np.uint8) for name, (_, _, n) in spans.items()}
    with pytest.raises(OSError, match=r"blob\.bin.*truncated"):
        for run in runs:
            reader().read(run, targets)


def test_a_file_system_without_o_direct_is_detected(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"x")
    real_open = os.open

    def tmpfs_open(file, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(file, flags, *args)

    monkeypatch.setattr(offload.disk_reads.os, "open", tmpfs_open)
    assert not DirectReader.supported(path)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_disk_tier_reads_layers_equal_to_the_memory_map(tmp_path, direct, dtype):
    from conftest import make_tiny_checkpoint
    folder = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=3)[0]
    source = CheckpointSource(folder)
    layout = source.layout(dtype)
    tier = DiskTier(source, layout, direct=direct)
    assert tier.is_direct == (direct and DirectReader.supported(source.file_paths()[0]))
    buffer = torch.zeros(layout.num_bytes, dtype=torch.uint8)
    for index in range(3):
        tier.read_into(index, buffer)
        views = layout.views(buffer)
        for name, tensor in source.layer(index).items():
            assert torch.equal(views[name], tensor.to(dtype)), (index, name)
        entries = source.layer_entries(index).values()
        plan = tier.span_plan(index)    # a whole-layer read: direct, no cast, every tensor 16-byte aligned
        assert (plan is not None) == (tier.is_direct and dtype == torch.float32
                                      and all(entry.start % 16 == 0 for _, entry in entries))
        if plan is not None:
            span = aligned_host(tier.span_bytes([index]), pin=False)
            got = tier.typed_views(tier.read_span(index, span))
            for name, tensor in source.layer(index).items():
                assert got[name].dtype == dtype and torch.equal(got[name], tensor), (index, name)
    tier.close()


def test_an_unaligned_tensor_is_read_into_the_layout_not_used_in_place(tmp_path):
    from conftest import make_tiny_checkpoint
    from offload.weights.safetensors_io import write_safetensors
    folder = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=1)[0]
    tensors = {"a_odd": torch.zeros(3, dtype=torch.uint8), **_all_tensors(folder)}   # written first: the rest odd
    for path in folder.glob("*.safetensors"):
        path.unlink()
    write_safetensors(folder / "model.safetensors", tensors)
    source = CheckpointSource(folder)
    tier = DiskTier(source, source.layout(torch.float32), direct=True)
    assert tier.span_plan(0) is None and tier.span_bytes([0]) == 0


@pytest.mark.parametrize("start,length", [(0, 50_000), (3, 4093), (4096, 8192), (45_000, 10_000), (5, 1)])
def test_a_cold_read_counts_exactly_the_range_bytes(tmp_path, start, length):
    from offload.bandwidth import read_range_cold
    from offload.disk_reads import aligned_buffer
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(50_000))
    direct = DirectReader.supported(path)
    assert read_range_cold(path, start, length, aligned_buffer(8192), direct) == min(length, 50_000 - start)



def _all_tensors(folder):
    from safetensors.torch import load_file
    tensors = {}
    for path in folder.glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    return tensors


@pytest.mark.parametrize("direct", [False, True])
def test_a_layer_split_across_shards_is_read_from_each(tmp_path, direct):
    """Small shards put one layer's tensors in several files: a run per file, every tensor's bytes."""
    from conftest import make_tiny_checkpoint
    folder = make_tiny_checkpoint(tmp_path, "llama", num_hidden_layers=2, save_kwargs={"max_shard_size": "20KB"})[0]
    source = CheckpointSource(folder)
    assert len(source.file_paths()) > 2
    layout = source.layout(torch.float32)
    tier = DiskTier(source, layout, direct=direct)
    buffer = aligned_host(layout.num_bytes, pin=False)
    assert max(len({path for path, _ in source.layer_entries(i).values()}) for i in range(2)) > 1
    for index in range(2):
        runs, _ = tier._layer_runs(index)
        assert len({run.path for run in runs}) == len({path for path, _ in source.layer_entries(index).values()})
        tier.read_into(index, buffer)
        for name, tensor in source.layer(index).items():
            assert torch.equal(layout.views(buffer)[name], tensor), (index, name)
    tier.close()
    gpu_style = DiskTier(source, layout, direct=direct, span_align=1)   # a GPU ring copies bytes per tensor
    if not gpu_style.is_direct:
        assert gpu_style.span_plan(0) is None
        return
    span = aligned_host(gpu_style.span_bytes([0, 1]), pin=False)
    for index in range(2):
        pieces = gpu_style.read_span(index, span)
        for name, tensor in source.layer(index).items():
            assert torch.equal(pieces[name], tensor.reshape(-1).view(torch.uint8)), (index, name)
    gpu_style.close()

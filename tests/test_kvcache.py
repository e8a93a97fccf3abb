"""KVCache append / commit / truncate semantics, and commit after a tree forward."""
from __future__ import annotations

import pytest
import torch

from offload.model.config import ModelConfig
from offload.model.kvcache import CacheFullError, KVCache
from trees import tree_mask

from conftest import hf_logits, load_ours

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 3


def _config() -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=16, hidden_size=12, intermediate_size=8, num_layers=LAYERS,
                       num_heads=4, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6, max_position=64)


def _cache(max_length: int = 10) -> KVCache:
    return KVCache(_config(), max_length, torch.device("cpu"), torch.float32)


def _tokens(first: int, count: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values [1, KVH, count, D] whose every entry encodes (token id, layer): easy to trace."""
    ids = torch.arange(first, first + count, dtype=torch.float32)
    keys = (ids + 100 * layer)[None, None, :, None].expand(1, KV_HEADS, count, HEAD_DIM).clone()
    return keys, -keys


def _reserve(cache: KVCache, first: int, count: int, keep_pending: bool = False) -> None:
    cache.reserve(count, torch.arange(first, first + count)[None], keep_pending)


def _append_all_layers(cache: KVCache, first: int, count: int, keep_pending: bool = False) -> None:
    _reserve(cache, first, count, keep_pending)
    for layer in range(LAYERS):
        cache.append(layer, *_tokens(first, count, layer))


def _slot_ids(cache: KVCache, layer: int, upto: int) -> list[int]:
    """Token ids stored in slots [0, upto) of `layer`, checked consistent over heads/dims/values."""
    keys = cache.keys[layer, 0, :, :upto]
    values = cache.values[layer, 0, :, :upto]
    assert torch.equal(values, -keys)
    assert (keys == keys[:1, :, :1]).all()
    return [int(k) - 100 * layer for k in keys[0, :, 0].tolist()]


def test_append_returns_cache_plus_new_and_leaves_pending():
    cache = _cache()
    _append_all_layers(cache, 0, 3)
    cache.commit()
    _reserve(cache, 3, 2)
    keys, values = cache.append(1, *_tokens(3, 2, 1))
    assert keys.shape == values.shape == (1, KV_HEADS, 5, HEAD_DIM)
    assert keys[0, 0, :, 0].tolist() == [100, 101, 102, 103, 104]
    assert torch.equal(values, -keys)
    assert cache.length == 3 and cache.num_pending == 2


def test_kept_pending_slots_accumulate_over_passes_and_commit_picks_among_all():
    cache = _cache()
    _append_all_layers(cache, 0, 2)
    cache.commit()
    _append_all_layers(cache, 10, 3)                       # pending 0..2
    _append_all_layers(cache, 20, 2, keep_pending=True)    # pending 3..4, after the first three
    assert cache.length == 2 and cache.num_pending == 5 and cache.num_slots == 7
    assert cache.key_positions()[0].tolist() == [0, 1, 10, 11, 12, 20, 21]
    cache.commit([1, 4])
    for layer in range(LAYERS):
        assert _slot_ids(cache, layer, 4) == [0, 1, 11, 21]
    _append_all_layers(cache, 30, 1)
    _append_all_layers(cache, 40, 1)                       # not kept: replaces the pending slot
    assert cache.num_pending == 1
    cache.commit()
    assert _slot_ids(cache, 0, 5) == [0, 1, 11, 21, 40]


def test_commit_all_keeps_every_pending_slot():
    cache = _cache()
    _append_all_layers(cache, 0, 4)
    assert cache.length == 0 and cache.num_pending == 4
    cache.commit()
    assert cache.length == 4 and cache.num_pending == 0
    _append_all_layers(cache, 4, 2)
    cache.commit(None)
    assert cache.length == 6
    for layer in range(LAYERS):
        assert _slot_ids(cache, layer, 6) == [0, 1, 2, 3, 4, 5]


# [5, 1]: slots land in the order given (tree paths always list ancestors first, so sorted in practice)
@pytest.mark.parametrize("kept", [[0, 2, 5], [1, 3], [4], [0, 1, 2], [5, 1]])
def test_commit_subset_compacts_in_order(kept):
    cache = _cache()
    _append_all_layers(cache, 0, 3)          # committed prefix: tokens 0, 1, 2
    cache.commit()
    _append_all_layers(cache, 3, 6)          # pending: tokens 3..8 = new indices 0..5
    cache.commit(kept)
    assert cache.length == 3 + len(kept) and cache.num_pending == 0
    for layer in range(LAYERS):
        assert _slot_ids(cache, layer, cache.length) == [0, 1, 2] + [3 + i for i in kept]


def test_commit_subset_accepts_tensor_and_empty():
    cache = _cache()
    _append_all_layers(cache, 0, 4)
    cache.commit(torch.tensor([1, 3]))
    assert cache.length == 2
    assert _slot_ids(cache, 0, 2) == [1, 3]
    _append_all_layers(cache, 10, 3)
    cache.commit([])
    assert cache.length == 2 and cache.num_pending == 0
    assert _slot_ids(cache, 1, 2) == [1, 3]


@pytest.mark.parametrize("bad", [[4], [0, 4], [-1], [0, 7]])
def test_commit_out_of_range_raises_index_error(bad):
    cache = _cache()
    _append_all_layers(cache, 0, 2)
    cache.commit()
    _append_all_layers(cache, 2, 4)
    with pytest.raises(IndexError):
        cache.commit(bad)
    assert cache.length == 2  # nothing committed by the failed call


def test_commit_after_commit_has_nothing_pending():
    cache = _cache()
    _append_all_layers(cache, 0, 2)
    cache.commit()
    with pytest.raises(IndexError):
        cache.commit([0])


def test_truncate_drops_tail_and_pending():
    cache = _cache()
    _append_all_layers(cache, 0, 5)
    cache.commit()
    _append_all_layers(cache, 5, 2)
    cache.truncate(3)
    assert cache.length == 3 and cache.num_pending == 0
    _append_all_layers(cache, 20, 2)        # new tokens overwrite from slot 3
    cache.commit()
    for layer in range(LAYERS):
        assert _slot_ids(cache, layer, 5) == [0, 1, 2, 20, 21]
    cache.truncate(0)
    assert cache.length == 0
    for bad in (-1, 1):
        with pytest.raises(ValueError):
            cache.truncate(bad)


def test_overflow_raises_cache_full():
    cache = _cache(max_length=5)
    _append_all_layers(cache, 0, 4)
    cache.commit()
    with pytest.raises(CacheFullError):
        _reserve(cache, 4, 2)
    _append_all_layers(cache, 4, 1)   # exactly full is fine
    cache.commit()
    assert cache.length == 5
    with pytest.raises(CacheFullError):
        _reserve(cache, 5, 1)


def test_model_forward_overflow_raises_cache_full(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama")
    ours = load_ours(folder)
    cache = ours.new_cache(8)
    with pytest.raises(CacheFullError):
        ours.forward(torch.zeros(1, 9, dtype=torch.long), cache)


def test_invalid_sizes_raise():
    with pytest.raises(ValueError):
        KVCache(_config(), 0, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError):
        KVCache(_config(), 4, torch.device("cpu"), torch.float32, batch_size=0)


def test_num_bytes_and_shape():
    cache = KVCache(_config(), 7, torch.device("cpu"), torch.bfloat16, batch_size=2)
    assert cache.keys.shape == (LAYERS, 2, KV_HEADS, 7, HEAD_DIM)
    assert cache.num_bytes == 2 * LAYERS * 2 * KV_HEADS * 7 * HEAD_DIM * 2


PARENTS = [-1, 0, 0, 1, 1, 2, 5]
DEPTHS = [0, 1, 1, 2, 2, 2, 3]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("accepted", [[0, 1, 4], [0, 2, 5, 6], [0, 1, 3], [0]])
def test_commit_tree_path_then_decode_matches_sequential(tiny_checkpoint, family, accepted):
    folder, hf_model = tiny_checkpoint(family)
    ours = load_ours(folder)
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 256, (1, 5), generator=gen)
    nodes = torch.randint(0, 256, (1, len(PARENTS)), generator=gen)
    follow = torch.randint(0, 256, (1, 1), generator=gen)
    for child, parent in zip(accepted[1:], accepted[:-1]):   # a root-to-node path
        assert PARENTS[child] == parent

    cache = ours.new_cache(24)
    ours.forward(prefix, cache)
    cache.commit()
    positions = (prefix.shape[1] + torch.tensor(DEPTHS))[None]
    ours.forward(nodes, cache, positions=positions, mask=tree_mask(torch.tensor(PARENTS), cache.length))
    cache.commit(accepted)
    assert cache.length == prefix.shape[1] + len(accepted)
    after_tree = ours.forward(follow, cache).logits[:, -1]

    sequence = torch.cat((prefix, nodes[:, accepted], follow), dim=1)
    sequential_cache = ours.new_cache(24)
    for i in range(sequence.shape[1]):
        step = ours.forward(sequence[:, i:i + 1], sequential_cache).logits[:, -1]
        sequential_cache.commit()
    torch.testing.assert_close(after_tree, step, atol=1e-4, rtol=0)
    torch.testing.assert_close(after_tree, hf_logits(hf_model, sequence)[:, -1], atol=1e-4, rtol=0)
    # the compacted cache holds exactly what sequential decoding stored
    n = sequence.shape[1]
    torch.testing.assert_close(cache.keys[:, :, :, :n], sequential_cache.keys[:, :, :, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.values[:, :, :, :n], sequential_cache.values[:, :, :, :n], atol=1e-5, rtol=0)


def test_chunked_prefill_matches_single_pass_prefill(tiny_checkpoint):
    from conftest import load_ours
    from spec import DecodeConfig, Decoder, SamplingConfig
    folder, _ = tiny_checkpoint("llama")
    model = load_ours(folder)
    prompt = list(range(3, 40))
    whole = Decoder(model, set(), DecodeConfig(8, 128, max_pass_tokens=512)).generate(prompt, SamplingConfig())
    chunked = Decoder(model, set(), DecodeConfig(8, 128, max_pass_tokens=5)).generate(prompt, SamplingConfig())
    assert chunked.token_ids == whole.token_ids
    assert chunked.stats.num_target_passes == whole.stats.num_target_passes + 7   # ceil(37 / 5) - 1 extra passes

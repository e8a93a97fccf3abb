"""bench/products_bench.py's count of a token's products, as each engine runs them (llama.cpp's mix of types in a
Q4_K_M file: attn_v and ffn_down in Q6_K in the first and last eighth of the layers and every third between)."""
from __future__ import annotations

from bench.products_bench import HEAD_ROWS, per_token, token_products
from bench.synthetic_gguf import NAMED_SHAPES
from offload.weights.ggml_types import GGMLType as T


def test_a_q4_k_m_token_counts_llama_cpps_mix_of_products():
    shape = NAMED_SHAPES["1b"]                 # 16 layers: more bits in 0, 1, 4, 7, 10, 13, 14, 15
    kv = shape.num_kv_heads * shape.head_dim
    apart = token_products(shape, "q4_k_m", stacked=False)
    assert apart[(T.Q6_K, kv, 2048)] == 8 and apart[(T.Q4_K, kv, 2048)] == 16 + 8     # k in every layer, v in 8
    assert apart[(T.Q6_K, 2048, 8192)] == 8 and apart[(T.Q4_K, 2048, 8192)] == 8
    assert apart[(T.Q4_K, 8192, 2048)] == 32 and apart[(T.Q4_0, HEAD_ROWS, 2048)] == 1
    assert sum(apart.values()) == 16 * 7 + 1
    stacked = token_products(shape, "q4_k_m", stacked=True)
    assert stacked[(T.Q4_K, 2048 + 2 * kv, 2048)] == 8        # q/k/v stacked only where v is Q4_K too
    assert stacked[(T.Q4_K, 2 * 8192, 2048)] == 16
    assert sum(stacked.values()) == 8 * 4 + 8 * 6 + 1


def test_a_tokens_time_is_each_products_time_times_its_count():
    counts = token_products(NAMED_SHAPES["1b"], "q4_0", stacked=True)
    assert per_token(counts, {p: 0.5 for p in counts}) == 0.5 * (16 * 4 + 1)

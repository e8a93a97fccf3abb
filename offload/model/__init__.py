"""offload/model/: the model's math: config, the layer-wise forward, rope, masks and the KV cache."""
from .config import ModelConfig, UnsupportedModelError
from .decoder import DecoderModel, ForwardOutput
from .kvcache import KVCache
from .masks import causal_mask

__all__ = ["ModelConfig", "UnsupportedModelError", "DecoderModel", "ForwardOutput", "KVCache", "causal_mask"]

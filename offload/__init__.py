"""offload/: model loading, the layer-wise forward, the KV cache, weight sources and tiers."""
from .config import ModelConfig, UnsupportedModelError
from .kvcache import KVCache
from .loader import LoadedModel, LoadOptions, load_model
from .masks import causal_mask, tree_mask
from .model import DecoderModel, ForwardOutput
from .tokenizer import StreamDecoder, Tokenizer

__all__ = ["ModelConfig", "UnsupportedModelError", "KVCache", "LoadedModel", "LoadOptions", "load_model",
           "causal_mask", "tree_mask", "DecoderModel", "ForwardOutput", "StreamDecoder", "Tokenizer"]

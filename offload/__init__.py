"""offload/: the layer-streaming engine (planner, tiers, prefetch ring, loader, host memory, bandwidth,
devices); the model's math in offload/model/, weight files and formats in offload/weights/."""
from .loader import LoadedModel, LoadOptions, load_model
from .model import DecoderModel, ForwardOutput, KVCache, ModelConfig, UnsupportedModelError, causal_mask
from .weights.tokenizer import StreamDecoder, Tokenizer

__all__ = ["ModelConfig", "UnsupportedModelError", "KVCache", "LoadedModel", "LoadOptions", "load_model",
           "causal_mask", "DecoderModel", "ForwardOutput", "StreamDecoder", "Tokenizer"]

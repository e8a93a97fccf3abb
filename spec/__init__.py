"""spec/: sampling, trees, drafting, verification and the decoding loop."""
from .decoding import DecodeConfig, Decoder, DecodeResult, DecodeStats
from .sampling import SamplingConfig, probabilities, sample

__all__ = ["DecodeConfig", "Decoder", "DecodeResult", "DecodeStats", "SamplingConfig", "probabilities", "sample"]

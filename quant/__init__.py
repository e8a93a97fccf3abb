"""quant/: SpQR-style packed weights: the versioned format, decode and fused kernel, the quantizer, baselines and perplexity."""

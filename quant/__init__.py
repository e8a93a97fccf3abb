"""quant/: SpQR-style packed weights (a later issue)."""

"""offload/weights/: weight files and formats: where a model comes from, safetensors and GGUF readers, the
packed-format interface a streamed layer is decoded through, and the tokenizer beside the weights."""

"""Models: a Llama-family causal LM in plain PyTorch and the Hugging Face directory reader."""

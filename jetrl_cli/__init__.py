"""jetrl: reinforcement learning of language models in low precision, on-policy."""

__version__ = "0.1.0"

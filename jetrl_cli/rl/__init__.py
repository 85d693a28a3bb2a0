"""GRPO with rollout-mismatch corrections: pure loss functions (``algos``), the trainer, the loop."""

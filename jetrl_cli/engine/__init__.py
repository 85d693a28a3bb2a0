"""Rollout: sampling, the embedded engine, and the interfaces other engines (vLLM) implement."""

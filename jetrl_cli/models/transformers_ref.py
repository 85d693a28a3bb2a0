"""``transformers`` models as a reference (``jetrl bench rollout`` times ``generate()`` next to
jetrl's engine), loaded quietly.

``from_pretrained`` takes the weights' dtype as ``dtype`` since transformers 4.56 and warns on the
old ``torch_dtype``; it also draws a "Loading weights" progress bar on stderr. Neither belongs in
jetrl's output: the dtype goes under the name the installed version reads, and transformers'
warnings and progress bars are off while the model loads (restored afterwards).
"""

from __future__ import annotations

from pathlib import Path


def _dtype_kwarg(version: str) -> str:
    major, minor = (int("".join(ch for ch in p if ch.isdigit()) or 0) for p in version.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_causal_lm(path: str | Path, dtype, device):
    """``AutoModelForCausalLM`` from a local directory in ``dtype`` on ``device``, in eval mode,
    without transformers' deprecation warnings or progress bar."""
    import transformers
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), **{_dtype_kwarg(transformers.__version__): dtype})
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    return model.to(device).eval()

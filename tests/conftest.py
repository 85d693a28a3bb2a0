"""Test set-up: Triton kernels run in Triton's interpreter on machines without a GPU."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is decorated: set before any import

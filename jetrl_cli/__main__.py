"""``python -m jetrl_cli``: the ``jetrl`` command (what ``torchrun ... -m jetrl_cli run PRESET`` starts)."""

from .cli import main

main()

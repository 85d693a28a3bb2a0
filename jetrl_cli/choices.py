"""Every list of choices a user picks from, declared once.

The preset schema (``config.py``), the CLI's help and checks, and the code that implements each
choice all read these tuples; the implementations check at import that they cover exactly these
names. Plain data, no torch: the CLI reads it at start-up.
"""

GEMM_BACKENDS = ("auto", "emulated", "scaled_mm", "triton", "invariant", "te")  # precision/gemm.py is the registry
CORRECTIONS = ("none", "tis", "mis", "acr")  # rl/algos.py
TIS_LEVELS = ("token", "sequence", "geometric")  # rl/algos.py _tis_weight (verl's levels)
LR_SCHEDULES = ("constant", "cosine")  # rl/trainer.py learning_rate
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")  # rl/algos.py advantages (verl's names)
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+")  # rl/algos.py kl_penalty
POLICY_LOSSES = ("ppo", "gspo")  # rl/algos.py policy_loss
# rl/algos.py (verl's names)
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ROLLOUT_BACKENDS = ("embedded", "vllm")  # rl/loop.py build_engine
VLLM_QUANTIZATIONS = ("jetrl", "fp8", "fp8-block", "none")  # engine/vllm_engine.py
CHECKPOINT_FORMATS = ("fp8-block", "fp8-tensor", "fp8-channel", "int8-channel")  # quantize_ckpt.py
TASKS = ("arith", "sort", "count", "mix", "jsonl")  # tasks.py build_task
ANSWER_FORMATS = ("auto", "boxed_or_gsm8k", "boxed", "gsm8k", "last_number")  # tasks.py ANSWER_FORMATS

"""Scale-out on ``torchrun``: one process per GPU (gloo processes on CPU), FSDP2 for the trainer,
a colocated data-parallel rollout, weight sync across ranks and DCP checkpoints.

The pieces, each behind a small interface so disaggregated rollout servers or multi-node placement
can replace one without touching the RL loop:

- ``world``: ``World`` (rank, size, collectives; ``SINGLE`` for the plain run) and ``shard_range``;
- ``sharding``: the sharding helper, ``shard_model`` (FSDP2 per decoder layer + root);
- ``trainer``: ``ShardedTrainer``, the GRPO trainer's ``score`` / ``update`` on sharded parameters;
- ``rollout``: ``ShardedEngine``, a ``RolloutEngine`` that samples this rank's prompts and gathers all;
- ``transport``: ``WeightTransport`` (``LocalTransport``, ``GatherTransport``);
- ``checkpoint``: DCP save / resume (any world size) next to the HF export;
- ``launch``: ``jetrl run --nproc N`` starting ``torchrun``.

The plain ``jetrl run`` imports only ``world`` (no ``torch.distributed``); ``SINGLE`` is its world.
"""

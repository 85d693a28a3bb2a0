"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), with a full HF export.

``OUT/checkpoints/step_000010/`` of a torchrun run holds what a single-process checkpoint holds
(``config.json``, ``model.safetensors`` with the full fp32 master weights, tokenizer files,
``trainer_state.pt`` with the step) and ``dcp/``: every rank's shards of the model and of AdamW's
state, plus DCP's metadata. It is written as one directory under a temporary name (each rank its
DCP files, rank 0 the metadata, the HF export and the trainer state) and renamed by rank 0 once
all are complete; ``OUT/latest`` then names it. A rank killed at any point leaves the last complete
checkpoint, which ``--resume`` starts from.

Resume (``restore_trainer``) reads whatever the checkpoint holds into whatever is running:

- a DCP checkpoint into a sharded trainer of any world size (DCP reshards), or into the plain
  single-process trainer (DCP loads without a process group);
- a single-process checkpoint (full optimizer state, indexed by parameter position) into a
  sharded trainer: renamed to parameter names and sharded by ``set_optimizer_state_dict``.

The model weights also come from the HF export, which every process loads at set-up; DCP's copy of
the model is loaded over it (the same fp32 values).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..rl.checkpoint import checkpoint_dirs, fresh_dir, load_trainer_state, publish_checkpoint, write_model_state
from ..errors import JetrlError
from .world import World

DCP_DIR = "dcp"


def save_sharded_checkpoint(out: Path, step: int, trainer, world: World, source_dir: Path, extra: dict,
                            keep: int) -> Path:
    """Every rank calls this at the same step; returns the checkpoint directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    tmp, final = checkpoint_dirs(out, step)
    if world.is_writer:
        fresh_dir(tmp)
    world.barrier()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp / DCP_DIR)
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if world.is_writer:
        write_model_state(tmp, trainer.model, full, source_dir)
        torch.save({"step": step, "optimizer": None, "sharded_state": DCP_DIR, "world_size": world.size, **extra},
                   tmp / "trainer_state.pt")
        publish_checkpoint(out, tmp, final, keep)
    world.barrier()
    return final


def _named_optimizer_state(state: dict, model: torch.nn.Module) -> dict:
    """A single-process ``optimizer.state_dict()`` (parameters by position among those that train)
    keyed by parameter name, the form ``set_optimizer_state_dict`` takes."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {
        "state": {names[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def restore_trainer(trainer, ckpt: Path, world: World) -> int:
    """Load the optimizer state (and, from DCP, the model) saved in ``ckpt``; returns its step."""
    state = load_trainer_state(ckpt)
    if state.get("sharded_state"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(trainer.model, trainer.opt)
        sd = {"model": model_sd, "optimizer": optim_sd}
        with warnings.catch_warnings():  # the plain run loads without a process group, on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=ckpt / state["sharded_state"])
        set_state_dict(trainer.model, trainer.opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        return state["step"]
    path = ckpt / "trainer_state.pt"
    saved = state.get("optimizer")
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
        raise JetrlError(f"{path}: holds no optimizer state (a trainer state of another program, or damaged); "
                         f"resume from an earlier checkpoint: point {ckpt.parent.parent / 'latest'} at it")
    try:
        if world.distributed:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(trainer.model, trainer.opt, _named_optimizer_state(saved, trainer.model),
                                     options=StateDictOptions(full_state_dict=True))
        else:
            trainer.opt.load_state_dict(saved)
    except (KeyError, IndexError, ValueError, TypeError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise JetrlError(f"{path}: its optimizer state does not fit this model's parameters ({first[:120]}); "
                         "the file is damaged or from another model") from None
    return state["step"]

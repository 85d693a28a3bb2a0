"""Where rollout and trainer stop agreeing: the first stage whose bits differ.

The rollout computes a token's hidden states in a decode step (the token alone, its keys read from
the KV cache, GEMMs of a few rows); the trainer computes them in one forward over the whole
sequence. When the two precisions are the same and every kernel is batch-invariant, every stage
agrees bit for bit; when the logprobs differ, the first stage that differs names the kernels that
broke equality (the GEMMs and attention of that decoder layer, the final norm, the lm_head or the
log-softmax).

``decode_divergence`` replays sampled sequences through ``prefill`` + ``decode`` with the rollout
model, exactly as the engine does, captures each decoder layer's output at every position, and
compares it with the trainer model's full forward at the same positions.
"""

from __future__ import annotations

import torch

from ..engine.sampling import SamplingParams, invariant_for, sampling_logprobs
from ..models.llama import key_width, layer_output


def _capture(model):
    """Forward hooks on every decoder layer and the final norm; returns (outputs list, remove)."""
    outs: list[list[torch.Tensor]] = [[] for _ in range(len(model.model.layers) + 1)]
    hooks = [layer.register_forward_hook(lambda m, i, o, j=j: outs[j].append(layer_output(o).detach().float()))
             for j, layer in enumerate(model.model.layers)]
    hooks.append(model.model.norm.register_forward_hook(lambda m, i, o: outs[-1].append(o.detach().float())))
    return outs, lambda: [h.remove() for h in hooks]


@torch.no_grad()
def decode_divergence(rollout_model, train_model, prompts: list[list[int]], completions: list[list[int]],
                      sampling: SamplingParams, width: int) -> dict:
    """Compare the rollout path (prefill, then one decode step per completion token) with the
    trainer's full forward, stage by stage, on the completion positions of ``prompts`` +
    ``completions`` (one right-padded batch, decoded in lockstep up to the shortest completion)."""
    dev = rollout_model.lm_head.weight.device
    steps = min(len(c) for c in completions)
    if steps == 0:
        return {"first_divergent": None, "stages": [], "positions": 0}
    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    ids = torch.zeros(b, int(lengths.max()), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p, device=dev)
    outs, remove = _capture(rollout_model)
    try:
        cache = rollout_model.new_cache(b, width)
        roll_logits = [rollout_model.prefill(ids, lengths, cache)]
        pre = [o.pop() for o in outs]  # prefill: (b, t, hidden) per stage
        for s in range(steps - 1):
            tok = torch.tensor([c[s] for c in completions], device=dev)
            w = key_width(int(lengths.max()) + s + 1)
            roll_logits.append(rollout_model.decode(tok, cache, w))
    finally:
        remove()
    # positions compared: each prompt's last token (prefill), then completion tokens 0 .. steps-2
    roll = []
    for j, o in enumerate(outs):
        first = pre[j][torch.arange(b, device=dev), lengths - 1]
        roll.append(torch.stack([first] + [x[:, 0] for x in o], dim=1))  # (b, steps, hidden)
    full_ids = torch.zeros(b, int(lengths.max()) + steps, dtype=torch.long, device=dev)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        full_ids[i, :len(p) + steps] = torch.tensor(p + c[:steps], device=dev)
    outs_t, remove = _capture(train_model)
    try:
        full_logits = train_model(full_ids)
    finally:
        remove()
    pos = lengths[:, None] - 1 + torch.arange(steps, device=dev)[None, :]  # (b, steps)
    rows = torch.arange(b, device=dev)[:, None]
    stages = []
    names = [f"decoder layer {j}" for j in range(len(rollout_model.model.layers))] + ["final norm"]
    for name, r, t in zip(names, roll, (o[0] for o in outs_t)):
        stages.append({"stage": name, "max_abs_diff": float((r - t[rows, pos]).abs().max()),
                       "frac_equal": float((r == t[rows, pos]).all(-1).double().mean())})
    lr = torch.stack(roll_logits, dim=1)
    lt = full_logits[rows, pos]
    stages.append({"stage": "lm_head (logits)", "max_abs_diff": float((lr - lt).abs().max()),
                   "frac_equal": float((lr == lt).all(-1).double().mean())})
    inv_r = invariant_for(rollout_model, lr)
    inv_t = invariant_for(train_model, lt)
    pr = sampling_logprobs(lr.reshape(-1, lr.shape[-1]), sampling, inv_r)
    pt = sampling_logprobs(lt.reshape(-1, lt.shape[-1]), sampling, inv_t)
    # With top-k/top-p a token beyond the cut has logprob -inf: max_abs_diff is over the tokens both sides
    # keep; a token one side cuts and the other keeps is counted apart (its difference is not a number).
    both = pr.isfinite() & pt.isfinite()
    diff = torch.where(both, pr - pt, torch.zeros_like(pr)).abs()
    stages.append({"stage": "log-softmax (logprobs)", "max_abs_diff": float(diff.max()),
                   "frac_equal": float(((pr == pt) | (pr.isinf() & pt.isinf())).all(-1).double().mean()),
                   "frac_cut_differs": float((pr.isinf() != pt.isinf()).any(-1).double().mean())})
    first = next((s["stage"] for s in stages if s["frac_equal"] < 1.0), None)
    return {"first_divergent": first, "stages": stages, "positions": b * steps}

"""A Llama-family causal LM in plain PyTorch (Llama, Qwen2, Mistral, SmolLM layouts).

Module and parameter names follow Hugging Face's (``model.layers.3.self_attn.q_proj`` ...), so a
HF safetensors state dict loads as is and the precision flow's skip list means the same thing
here, in vLLM and in transformers. All linear layers are ``Linear`` (an ``nn.Linear``) until the flow's swap turns them
into ``JetLinear``; norms, embeddings and attention softmax run in fp32.

Two ways to run it, one set of numerics:

- ``forward(input_ids, attention_mask)``: logits for every position (training, scoring);
- ``prefill`` / ``decode`` with a ``KVCache``: what the rollout engine runs, one token at a time.

Every op is computed so that a token's result does not depend on how many other rows are in the
batch or on whether it was computed in a full forward or in a decode step: GEMMs go through
``row_invariant_mm``, attention always reduces over the same fixed key width (the cache width) with
each sequence stored from index 0, and SiLU / RoPE avoid kernels whose vectorised and scalar
paths round differently. That is what lets the rollout's logprobs equal the trainer's bit for
bit when both run the same precision (tested in ``tests/test_engine.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..precision.gemm import ROW_TILE, row_invariant_mm
from ..precision.quant import CastSpec, fake_quantize, round_to


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # only llama3-style scaling is supported
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2: always)
    mlp_bias: bool = False


class Linear(nn.Linear):
    """``nn.Linear`` whose rows do not depend on the batch size (see ``row_invariant_mm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = row_invariant_mm(x.reshape(-1, x.shape[-1]), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    # torch's fused silu rounds its scalar tail differently from its vector body; exp and the
    # IEEE division do not, so this form is position-invariant.
    return x / (1 + torch.exp(-x))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = rs["factor"]
        lo, hi = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        lo_wl, hi_wl = old / lo, old / hi
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where((wavelen <= lo_wl) & (wavelen >= hi_wl), mid, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def cast_kv(t: torch.Tensor, spec: CastSpec | None) -> torch.Tensor:
    """Round keys/values to the KV-cache format (per token and head for fp8: rows of head_dim)."""
    if spec is None or spec.format.value == "fp32":
        return t
    with torch.no_grad():
        if spec.is_scaled:
            q = fake_quantize(t.reshape(-1, t.shape[-1]), spec).reshape(t.shape).to(t.dtype)
        else:
            q = round_to(t, spec.format).to(t.dtype)
    return t + (q - t).detach() if t.requires_grad else q  # straight-through in training


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    t = x.shape[-2]
    pad = (-t) % ROW_TILE
    return F.pad(x, (0, 0, 0, pad)) if pad else x


class KVCache:
    """Per-layer keys/values, ``(batch, kv_heads, width, head_dim)``, each sequence from index 0."""

    def __init__(self, cfg: ModelConfig, batch: int, width: int, dtype=torch.float32, device=None):
        shape = (batch, cfg.num_key_value_heads, width, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.width = width

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (finished sequences leave the batch)."""
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]
        self.lengths = self.lengths[rows]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_attention_heads * d, h, bias=False)
        self.kv_spec: CastSpec | None = None

    def forward(self, x, cos, sin, q_index, key_keep, width, cache: KVCache | None = None, layer: int = 0):
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = cast_kv(k, self.kv_spec), cast_kv(v, self.kv_spec)
        if cache is None:
            keys = F.pad(k, (0, 0, 0, width - t))
            values = F.pad(v, (0, 0, 0, width - t))
        else:
            bi = torch.arange(b, device=x.device)[:, None].expand(b, t)
            cache.k[layer].transpose(1, 2)[bi, q_index] = k.transpose(1, 2).to(cache.k[layer].dtype)
            cache.v[layer].transpose(1, 2)[bi, q_index] = v.transpose(1, 2).to(cache.v[layer].dtype)
            keys, values = cache.k[layer], cache.v[layer]
        rep = c.num_attention_heads // c.num_key_value_heads
        if rep > 1:
            keys = keys.repeat_interleave(rep, dim=1)
            values = values.repeat_interleave(rep, dim=1)
        h, w, d = c.num_attention_heads, keys.shape[2], c.head_dim
        qf = _pad_rows(q.float().reshape(b * h, t, d))
        kf = keys.float().reshape(b * h, w, d).contiguous()
        vf = values.float().reshape(b * h, w, d).contiguous()
        att = torch.bmm(qf, kf.transpose(1, 2))[:, :t].view(b, h, t, w) * (d ** -0.5)
        j = torch.arange(w, device=x.device)
        allowed = j <= q_index[..., None]  # (b, t, w)
        if key_keep is not None:
            allowed = (allowed & key_keep[:, None, :]) | (j == q_index[..., None])
        att = att.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        out = torch.bmm(_pad_rows(att.reshape(b * h, t, w)), vf)[:, :t]
        out = out.view(b, h, t, d).to(x.dtype).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, q_index, key_keep, width, cache=None, layer=0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, q_index, key_keep, width, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- shared pieces ---------------------------------------------------------------------

    def set_kv_spec(self, spec: CastSpec | None) -> None:
        """The format keys and values are rounded to (the KV cache's, in every forward)."""
        for layer in self.model.layers:
            layer.self_attn.kv_spec = spec

    def _cos_sin(self, pos: torch.Tensor):
        """RoPE angles from one table, so a position gets the same bits in every batch shape."""
        need = int(pos.max()) + 1 if pos.numel() else 1
        if self._rope is None or self._rope[0].shape[0] < need or self._rope[0].device != pos.device:
            n = max(need, self.config.max_position_embeddings)
            ang = torch.arange(n, device=pos.device, dtype=torch.float32)[:, None] * self.inv_freq.to(pos.device)
            emb = torch.cat((ang, ang), dim=-1)
            self._rope = (emb.cos(), emb.sin())
        cos, sin = self._rope
        return cos[pos][:, None], sin[pos][:, None]

    def _trunk(self, input_ids, pos, q_index, key_keep, width, cache=None) -> torch.Tensor:
        cos, sin = self._cos_sin(pos)
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, q_index, key_keep, width, cache, i)
        return self.model.norm(x)

    # -- full sequences (training, scoring) -----------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, width: int | None = None
    ) -> torch.Tensor:
        """Logits (fp32) for every position.

        ``attention_mask``: 1 for real tokens, 0 for padding (left or right). ``width``: the key
        width attention reduces over (default: the sequence length); pass the rollout's cache width
        to reproduce its numerics bit for bit on right-padded sequences.
        """
        b, t = input_ids.shape
        dev = input_ids.device
        width = t if width is None else width
        if width < t:
            raise ValueError(f"width {width} is shorter than the sequence ({t} tokens)")
        q_index = torch.arange(t, device=dev).expand(b, t)
        if attention_mask is None:
            pos, keep = q_index, None
        else:
            keep = F.pad(attention_mask.bool(), (0, width - t))
            pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        h = self._trunk(input_ids, pos, q_index, keep, width)
        return self.lm_head(h).float()

    # -- incremental decoding (the rollout engine) ----------------------------------------

    def new_cache(self, batch: int, width: int) -> KVCache:
        p = self.lm_head.weight
        return KVCache(self.config, batch, width, dtype=torch.float32 if p.dtype == torch.float32 else p.dtype,
                       device=p.device)

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Fill the cache with right-padded prompts; logits (fp32) at each prompt's last token."""
        b, t = input_ids.shape
        idx = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self._trunk(input_ids, idx, idx, None, cache.width, cache)
        cache.lengths = lengths.clone()
        last = h[torch.arange(b, device=h.device), lengths - 1]
        return self.lm_head(last).float()

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append one token per sequence at its own length; logits (fp32) for the next token."""
        idx = cache.lengths[:, None]
        h = self._trunk(tokens[:, None], idx, idx, None, cache.width, cache)
        cache.lengths = cache.lengths + 1
        return self.lm_head(h[:, 0]).float()

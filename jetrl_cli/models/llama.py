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
``row_invariant_mm``, attention runs over a key width that is a multiple of ``KEY_CHUNK`` and reduces
over keys in fixed chunks of ``PV_CHUNK`` with each sequence stored from index 0 (so keys past a
sequence's end add exact zeros, whatever the width), and SiLU / RoPE avoid kernels whose
vectorised and scalar paths round differently. That is what lets the rollout's logprobs equal the
trainer's bit for bit when both run the same precision (tested in ``tests/test_engine.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..precision.gemm import _values, row_invariant_mm
from ..precision.linear import JetLinear, _finish, cast_operand
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
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # F.rms_norm's own ops (mean = sum, then div_), without its ~10 dtype checks and copies
            ms = (x * x).sum(-1, keepdim=True).div_(x.shape[-1])
            return x * torch.rsqrt(ms.add_(self.eps)) * self.weight
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
    """``x * cos + rotate_half(x) * sin``; ``sin`` comes with the sign of rotate_half folded in."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin  # roll by half: [x2, x1]


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without a dispatcher call when it is already that dtype (decode steps
    are made of small ops, and each call costs microseconds)."""
    return t if t.dtype is dtype else t.to(dtype)


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


KEY_CHUNK = 16  # key widths are multiples of this
PV_CHUNK = 128  # keys per p @ v GEMM (the last one of a width may hold 64)


def key_width(n: int) -> int:
    """The key width attention runs over for ``n`` keys: a multiple of ``KEY_CHUNK``."""
    return -(-n // KEY_CHUNK) * KEY_CHUNK


def _chunked_pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``p @ v`` reduced over keys ``PV_CHUNK`` at a time, chunk results added in order: a key
    block past every sequence's end adds exact zeros, so the result does not depend on the width
    (one bmm over a long width changes its summation blocking with the width)."""
    out = None
    for s in range(0, p.shape[-1], PV_CHUNK):
        part = torch.bmm(p[..., s:s + PV_CHUNK], v[:, s:s + PV_CHUNK])
        out = part if out is None else out + part
    return out


ATT_ROW_TILE = 4  # attention GEMMs: this BLAS runs one kernel for every M >= 4 (tests/test_engine.py)


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    t = x.shape[-2]
    pad = (-t) % ATT_ROW_TILE
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def _decode_attention(q, kf, vf, bias, rep: int) -> torch.Tensor:
    """Attention for one query per sequence (a decode step), (b, 1, heads * d): the same bits as
    the general path, with fewer ops. The query rows of a KV head are padded to ``ATT_ROW_TILE``
    once, and the padding rows (zeros) go through softmax and ``p @ v`` with the real ones instead
    of being cut and padded again (rows never affect each other; their softmax is finite)."""
    b, h, _, d = q.shape
    hk = h // rep
    tile = -(-rep // ATT_ROW_TILE) * ATT_ROW_TILE
    qf = torch.zeros(b * hk, tile, d, dtype=torch.float32, device=q.device)
    torch.mul(_as(q, torch.float32).reshape(b, hk, rep, d), d ** -0.5, out=qf.view(b, hk, tile, d)[:, :, :rep])
    att = torch.bmm(qf, kf.transpose(1, 2))
    w = att.shape[-1]
    att = (att.view(b, hk, tile, w) + bias.view(b, 1, 1, w)).softmax(-1)
    out = _chunked_pv(att.view(b * hk, tile, w), vf)
    return out.view(b, hk, tile, d)[:, :, :rep].reshape(b, 1, h * d)


def _fusable(lins) -> bool:
    if len({m.bias is None for m in lins}) > 1:
        return False
    if all(type(m) is Linear for m in lins):
        return True
    if not all(isinstance(m, JetLinear) for m in lins):
        return False
    p = lins[0].precision
    return all(m.precision == p for m in lins) and p.fprop.backend == "emulated"


def _weights_key(lins) -> tuple:
    """What a concatenated weight depends on: each layer's weight (storage and in-place version),
    bias version, precision object (set_precision replaces it) and loaded quantized weight, the
    last two by identity (the cache entry holds them, so their ids cannot be reused)."""
    key = []
    for m in lins:
        w, b = m.weight, m.bias
        key += (w.data_ptr(), w._version, -1 if b is None else b._version,
                id(getattr(m, "precision", None)), id(getattr(m, "_wfixed", None)))
    return tuple(key)


def fused_linears(lins, x: torch.Tensor, cache_owner: nn.Module) -> torch.Tensor:
    """Linear layers that read the same input, outputs concatenated along the last dim: one GEMM
    on a cached weight when no gradient is needed.

    Inference only (rollout, scoring): the input is cast once and the layers' (quantized,
    dequantized) weights are concatenated along N and kept until a weight changes. Each output
    element is the same dot product in the same order as the separate GEMMs' (this BLAS's results
    do not depend on N; ``tests/test_engine.py`` checks the model's grad and no-grad forwards agree
    bit for bit), so this is a pure speed-up. One layer is fine too: its weight is then not
    dequantized again at every call."""
    if torch.is_grad_enabled() or x.is_cuda:
        return lins[0](x) if len(lins) == 1 else torch.cat([m(x) for m in lins], dim=-1)
    key = _weights_key(lins)
    cached = cache_owner.__dict__.get("_fused_cache")
    if cached is None or cached[0] != key:
        if not _fusable(lins):
            cache_owner.__dict__["_fused_cache"] = None
            return lins[0](x) if len(lins) == 1 else torch.cat([m(x) for m in lins], dim=-1)
        jet = isinstance(lins[0], JetLinear)
        prec = lins[0].precision.fprop if jet else None
        ws = [_values(m.quantized_weight()) if jet else m.weight.detach() for m in lins]
        w = ws[0] if len(ws) == 1 else torch.cat(ws)
        b = torch.cat([m.bias.detach().float() for m in lins]) if lins[0].bias is not None else None
        held = [(getattr(m, "precision", None), getattr(m, "_wfixed", None)) for m in lins]
        cached = (key, prec, w, b, held)
        cache_owner.__dict__["_fused_cache"] = cached
    _, prec, w, b, _ = cached
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    xa = _values(cast_operand(x2, prec.a)) if prec is not None else x2
    acc = row_invariant_mm(xa, w)
    if b is not None:
        acc = acc + b
    y = _finish(acc, prec, x.dtype) if prec is not None else acc
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


class KVCache:
    """Keys and values of every layer in one tensor, ``(2 * layers, batch, kv_heads, width,
    head_dim)`` (layer i: keys at 2i, values at 2i+1), each sequence stored from index 0.

    ``storage``: a flat tensor to build the cache in (at least ``KVCache.numel(...)`` elements),
    reused from one rollout to the next. On CPU a fresh multi-MB tensor costs a page fault per
    4 KiB page on first touch, more than the copy that fills it."""

    def __init__(self, cfg: ModelConfig, batch: int, width: int, dtype=torch.float32, device=None,
                 storage: torch.Tensor | None = None):
        shape = (2 * cfg.num_hidden_layers, batch, cfg.num_key_value_heads, width, cfg.head_dim)
        if storage is None:
            kv = torch.zeros(shape, dtype=dtype, device=device)
        else:
            kv = _view(storage, shape).zero_()  # positions never written must hold finite values
        self._set(kv)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=kv.device)
        self.width = width
        self._index: tuple | None = None

    @staticmethod
    def numel(cfg: ModelConfig, batch: int, width: int) -> int:
        return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * width * cfg.head_dim

    def _set(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.k = list(kv[0::2])
        self.v = list(kv[1::2])

    def write_index(self, q_index: torch.Tensor) -> torch.Tensor:
        """Rows of the flattened ``(batch * kv_heads * width, head_dim)`` cache that the keys of
        ``q_index`` (batch, t) go to, in ``(batch, kv_heads, t)`` order; computed once per forward."""
        if self._index is not None and self._index[0] is q_index:
            return self._index[1]
        b, hk, w, _ = self.k[0].shape
        bh = torch.arange(b * hk, device=q_index.device).reshape(b, hk, 1)
        idx = (bh * w + q_index[:, None, :]).reshape(-1)
        self._index = (q_index, idx)
        return idx

    def select(self, rows: torch.Tensor, storage: torch.Tensor | None = None) -> None:
        """Keep only ``rows`` (finished sequences leave the batch, a prompt's cache is copied to
        its group), in one copy into ``storage`` (which must not be this cache's) or a new tensor."""
        shape = (self.kv.shape[0], rows.numel(), *self.kv.shape[2:])
        if storage is None:
            kv = self.kv.index_select(1, rows)
        else:
            kv = torch.index_select(self.kv, 1, rows, out=_view(storage, shape))
        self._set(kv)
        self.lengths = self.lengths.index_select(0, rows)
        self._index = None


def _view(storage: torch.Tensor, shape: tuple) -> torch.Tensor:
    n = math.prod(shape)
    if storage.numel() < n:
        raise ValueError(f"KV-cache storage holds {storage.numel()} elements, {n} needed")
    return storage[:n].view(shape)


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

    def forward(self, x, cos, sin, q_index, bias, width, cache: KVCache | None = None, layer: int = 0):
        b, t, _ = x.shape
        c = self.cfg
        h, hk = c.num_attention_heads, c.num_key_value_heads
        qkv = fused_linears((self.q_proj, self.k_proj, self.v_proj), x, self)
        # RoPE on queries and keys in one pass (elementwise: the same bits as two passes)
        qkv = qkv.reshape(b, t, h + 2 * hk, c.head_dim).transpose(1, 2)
        qk = apply_rope(qkv[:, :h + hk], cos, sin)
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + hk:]
        k, v = cast_kv(k, self.kv_spec), cast_kv(v, self.kv_spec)
        if cache is None:
            keys = F.pad(k, (0, 0, 0, width - t))
            values = F.pad(v, (0, 0, 0, width - t))
        else:
            ck, cv = cache.k[layer], cache.v[layer]
            idx = cache.write_index(q_index)
            ck.view(-1, ck.shape[-1]).index_copy_(0, idx, _as(k.reshape(-1, k.shape[-1]), ck.dtype))
            cv.view(-1, cv.shape[-1]).index_copy_(0, idx, _as(v.reshape(-1, v.shape[-1]), cv.dtype))
            keys, values = ck[:, :, :width], cv[:, :, :width]
        # GQA without copying the cache: the `rep` query heads sharing a KV head are stacked as rows
        # of one (rep*t, d) matrix per (sequence, KV head).
        rep = h // hk
        w, d = keys.shape[2], c.head_dim
        kf = _as(keys, torch.float32).reshape(b * hk, w, d)
        vf = _as(values, torch.float32).reshape(b * hk, w, d)
        if t == 1:
            out = _decode_attention(q, kf, vf, bias, rep)
        else:
            rows = rep * t
            qf = _pad_rows((q.float() * (d ** -0.5)).reshape(b * hk, rows, d))
            att = torch.bmm(qf, kf.transpose(1, 2))[:, :rows].reshape(b, hk, rep, t, w)
            att = (att + bias).softmax(-1)
            out = _chunked_pv(_pad_rows(att.reshape(b * hk, rows, w)), vf)[:, :rows]
            out = out.reshape(b, h, t, d).transpose(1, 2).reshape(b, t, -1)
        return fused_linears((self.o_proj,), _as(out, x.dtype), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x):
        g, u = fused_linears((self.gate_proj, self.up_proj), x, self).chunk(2, dim=-1)
        return fused_linears((self.down_proj,), silu(g) * u, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, q_index, bias, width, cache=None, layer=0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, q_index, bias, width, cache, layer)
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

    def _cos_sin(self, pos: torch.Tensor, need: int):
        """RoPE angles from one table, so a position gets the same bits in every batch shape.
        ``need``: a bound on the positions (the key width), so no host sync reads ``pos.max()``."""
        if self._rope is None or self._rope[0].shape[0] < need or self._rope[0].device != pos.device:
            n = max(need, self.config.max_position_embeddings)
            ang = torch.arange(n, device=pos.device, dtype=torch.float32)[:, None] * self.inv_freq.to(pos.device)
            emb = torch.cat((ang, ang), dim=-1)
            sin = emb.sin()
            sin[:, : sin.shape[1] // 2] *= -1  # rotate_half's sign, folded in (exact)
            self._rope = (emb.cos(), sin)
        cos, sin = self._rope
        return cos[pos][:, None], sin[pos][:, None]

    def _trunk(self, input_ids, pos, q_index, key_keep, width, cache=None) -> torch.Tensor:
        cos, sin = self._cos_sin(pos, width)  # every position is < width
        # Which keys each query sees, as an additive mask (0 or -inf), (b, 1, 1, t, width).
        j = torch.arange(width, device=input_ids.device)
        if key_keep is None:
            hidden = j > q_index[..., None]
        else:
            hidden = ~((j <= q_index[..., None]) & key_keep[:, None, :]) & (j != q_index[..., None])
        bias = torch.zeros(hidden.shape, device=input_ids.device).masked_fill_(hidden, float("-inf"))[:, None, None]
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, q_index, bias, width, cache, i)
        return self.model.norm(x)

    # -- full sequences (training, scoring) -----------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, width: int | None = None
    ) -> torch.Tensor:
        """Logits (fp32) for every position.

        ``attention_mask``: 1 for real tokens, 0 for padding (left or right). With right padding
        (or none) every token's logits are bit-identical to what ``prefill`` / ``decode`` compute.
        ``width`` (tests only) forces a larger key width; results do not depend on it.
        """
        b, t = input_ids.shape
        dev = input_ids.device
        width = key_width(max(t, width or 0))
        q_index = torch.arange(t, device=dev).expand(b, t)
        if attention_mask is None:
            pos, keep = q_index, None
        else:
            keep = F.pad(attention_mask.bool(), (0, width - t))
            pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        h = self._trunk(input_ids, pos, q_index, keep, width)
        return fused_linears((self.lm_head,), h, self.lm_head).float()

    # -- incremental decoding (the rollout engine) ----------------------------------------

    def new_cache(self, batch: int, max_len: int, storage: torch.Tensor | None = None) -> KVCache:
        return KVCache(self.config, batch, key_width(max_len), dtype=self.cache_dtype(),
                       device=self.lm_head.weight.device, storage=storage)

    def cache_dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Fill the cache with right-padded prompts; logits (fp32) at each prompt's last token."""
        b, t = input_ids.shape
        idx = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self._trunk(input_ids, idx, idx, None, key_width(t), cache)
        cache.lengths = lengths.clone()
        last = h[torch.arange(b, device=h.device), lengths - 1]
        return fused_linears((self.lm_head,), last, self.lm_head).float()

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append one token per sequence at its own length; logits (fp32) for the next token."""
        idx = cache.lengths[:, None]
        longest = int(cache.lengths.max())
        if longest >= cache.width:
            raise ValueError(f"KV cache full ({cache.width} positions)")
        h = self._trunk(tokens[:, None], idx, idx, None, key_width(longest + 1), cache)
        cache.lengths = cache.lengths + 1
        return fused_linears((self.lm_head,), h[:, 0], self.lm_head).float()

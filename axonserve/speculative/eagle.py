"""EAGLE-1 draft head: one Llama decoder layer that extrapolates the target's features.

Over 500 lines: the head, its packing, its chain and tree drafting share the head's KV
bookkeeping (the paged variant is paged_draft.py).

At position t the head reads `fc(cat(embed(tok_{t+1}), f_t))`, where f_t is the target's
post-final-norm hidden state (what `LlamaForCausalLM.forward` returns) and tok_{t+1} the token
that followed it, runs one decoder layer (RMSNorm, GQA attention with RoPE at absolute position
t, SwiGLU) and outputs f̂_{t+1}. Draft logits are the target's lm_head applied to f̂ but only
over a reduced draft vocabulary (EAGLE-3): a full 49k-row lm_head dominated a draft step
(docs/benchmarks.md#fig-speculative).

The head directory holds only fc + the layer + the draft->target id map + the config: the
embedding and lm_head rows are the target's, frozen, read from the target's safetensors.
Parameter names follow HF Llama (q_proj, gate_proj, ...) so a target layer can seed the head.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from axonserve.neuron.config import ModelConfig
from axonserve.neuron.layers.activation import silu_and_mul
from axonserve.neuron.layers.norm import rms_norm
from axonserve.neuron.layers.rotary import RotaryEmbedding, apply_rotary
from axonserve.neuron.loader import safetensors_files
from axonserve.neuron.sampler import greedy_ids

log = structlog.get_logger()

CONFIG_NAME = "eagle_config.json"
WEIGHTS_NAME = "model.safetensors"
D2T_NAME = "d2t"  # draft id -> target id map, saved next to the weights
HEADS_DIR = os.path.join(os.path.dirname(__file__), "heads")  # heads shipped as package data
_BUILTIN_HEADS = {
    "SmolLM2-135M-Instruct": "smollm2-135m-instruct",
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m-instruct",
}


def builtin_head_dir(model: str | None) -> str | None:
    """The head for a built-in model name (None: the default model): shipped in the package, else
    trained into ~/.cache/axonserve/eagle/ by `axonserve train-eagle`; None when there is none."""
    from axonserve.neuron.model_source import DEFAULT_MODEL, cache_dir

    name = _BUILTIN_HEADS.get(model or DEFAULT_MODEL)
    if name is None:
        return None
    for d in (os.path.join(HEADS_DIR, name), os.path.join(cache_dir(), "eagle", name)):
        if os.path.isfile(os.path.join(d, CONFIG_NAME)) and os.path.isfile(os.path.join(d, WEIGHTS_NAME)):
            return d
    return None


@dataclass
class EagleConfig:
    """Dimensions of the head (the target's) plus its draft vocabulary; saved as eagle_config.json."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    draft_vocab_size: int
    target_vocab_size: int
    target_model: str = ""  # the target it was trained for (name or path), informative
    target_tie_word_embeddings: bool = False

    @classmethod
    def from_target(cls, mc: ModelConfig, draft_vocab_size: int, target_model: str = "") -> "EagleConfig":
        return cls(
            hidden_size=mc.hidden_size,
            intermediate_size=mc.intermediate_size,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            rms_norm_eps=mc.rms_norm_eps,
            rope_theta=mc.rope_theta,
            rope_scaling=mc.rope_scaling,
            max_position_embeddings=mc.max_position_embeddings,
            draft_vocab_size=min(draft_vocab_size, mc.vocab_size),
            target_vocab_size=mc.vocab_size,
            target_model=target_model,
            target_tie_word_embeddings=mc.tie_word_embeddings,
        )

    def save(self, head_dir: str) -> None:
        with open(os.path.join(head_dir, CONFIG_NAME), "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=2)

    @classmethod
    def load(cls, head_dir: str) -> "EagleConfig":
        with open(os.path.join(head_dir, CONFIG_NAME)) as f:
            return cls(**json.load(f))


def read_target_tensors(target_dir: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Only the named tensors from the target's safetensors files (the target is never loaded whole)."""
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(target_dir):
        with safe_open(path, framework="pt") as h:
            for name in set(names) & set(h.keys()):
                out[name] = h.get_tensor(name)
    missing = set(names) - set(out)
    if missing:
        raise ValueError(f"{target_dir}: target checkpoint lacks {sorted(missing)}")
    return out


def target_vocab_tensors(target_dir: str, tied: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, H], lm_head [V, H]) of the target; one tensor when the target ties them."""
    names = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    t = read_target_tensors(target_dir, names)
    emb = t["model.embed_tokens.weight"]
    return emb, emb if tied else t["lm_head.weight"]


class EagleLayer(nn.Module):
    """One Llama decoder layer over a padded [B, T] batch, attending to a dense per-batch KV buffer."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

        # pack(): fused projections + the serving path's native kernels (inference only)
        self.packed_qkv: PackedLinear | None = None
        self.packed_gate_up: PackedLinear | None = None

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.packed_qkv is not None:  # the native fused kernel over [rows, H]
            return rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), w.detach(), self.eps).view(x.shape)
        return w * F.rms_norm(x.float(), w.shape, None, self.eps).to(x.dtype)

    def merged_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k/v and gate/up weights stacked, each one matmul's weight (pack(), the native stack)."""
        return (
            torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)),
            torch.cat((self.gate_proj.weight, self.up_proj.weight)),
        )

    def pack(self, quantization: str = "") -> None:
        """q/k/v and gate/up as one packed matmul each: a draft step is a handful of 1-4 row calls."""
        qkv, gate_up = self.merged_weights()
        self.packed_qkv = PackedLinear(qkv, None, quantization)
        self.packed_gate_up = PackedLinear(gate_up, None, quantization)
        self.o_proj = PackedLinear(self.o_proj.weight, None, quantization)
        self.down_proj = PackedLinear(self.down_proj.weight, None, quantization)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, H] -> q [B, Hq, T, D], k/v [B, Hkv, T, D] with RoPE applied (cos/sin [B, T, 1, D])."""
        b, t, _ = x.shape
        hx = self._norm(x, self.input_layernorm)
        hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.packed_qkv is not None:
            q, k, v = self.packed_qkv(hx).split((hq, hkv, hkv), dim=-1)
        else:
            q, k, v = self.q_proj(hx), self.k_proj(hx), self.v_proj(hx)
        q = apply_rotary(q.view(b, t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(b, t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def finish(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of q over keys k/v ([B, Hkv, S, D], mask [B|1, 1, T, S] bool), residuals, SwiGLU."""
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        hx = self._norm(x, self.post_attention_layernorm)
        if self.packed_gate_up is not None:
            return x + self.down_proj(silu_and_mul(self.packed_gate_up(hx)))
        return x + self.down_proj(F.silu(self.gate_proj(hx)) * self.up_proj(hx))


class EagleHead(nn.Module):
    """fc + one decoder layer; frozen target embedding and draft-vocab lm_head rows as buffers."""

    def __init__(self, cfg: EagleConfig, embed: torch.Tensor, lm_head: torch.Tensor, d2t: torch.Tensor):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = EagleLayer(cfg)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, torch.float32
        )
        if d2t.shape != (cfg.draft_vocab_size,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, config says {cfg.draft_vocab_size} draft tokens")
        self.register_buffer("d2t", d2t.long(), persistent=False)
        self.register_buffer("embed", embed, persistent=False)  # [V, H], frozen target rows
        self.register_buffer("lm_head", lm_head[d2t].contiguous(), persistent=False)  # [N, H] draft rows only
        self.packed_lm_head: PackedLinear | None = None  # pack(): the same rows in a packed layout

    # ----------------------------------------------------------------- construction / io

    @classmethod
    def from_target(
        cls, target_dir: str, d2t: torch.Tensor, target_model: str = "", dtype: torch.dtype = torch.float32
    ) -> "EagleHead":
        """A fresh (randomly initialised) head for the target in target_dir, with the given draft vocab."""
        mc = ModelConfig.from_dir(target_dir)
        cfg = EagleConfig.from_target(mc, len(d2t), target_model or target_dir)
        emb, lm = target_vocab_tensors(target_dir, mc.tie_word_embeddings)
        return cls(cfg, emb.to(dtype), lm.to(dtype), d2t).to(dtype)

    @classmethod
    def from_pretrained(cls, head_dir: str, target_dir: str, dtype: torch.dtype = torch.float32) -> "EagleHead":
        cfg = EagleConfig.load(head_dir)
        mc = ModelConfig.from_dir(target_dir)
        if (mc.hidden_size, mc.vocab_size) != (cfg.hidden_size, cfg.target_vocab_size):
            raise ValueError(
                f"head in {head_dir} was made for hidden {cfg.hidden_size} / vocab "
                f"{cfg.target_vocab_size}, target {target_dir} has {mc.hidden_size} / {mc.vocab_size}"
            )
        with safe_open(os.path.join(head_dir, WEIGHTS_NAME), framework="pt") as h:
            state = {k: h.get_tensor(k) for k in h.keys()}
        d2t = state.pop(D2T_NAME)
        emb, lm = target_vocab_tensors(target_dir, mc.tie_word_embeddings)
        head = cls(cfg, emb.to(dtype), lm.to(dtype), d2t).to(dtype)
        head.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
        log.info("eagle.loaded", head_dir=head_dir, draft_vocab=cfg.draft_vocab_size, dtype=str(dtype))
        return head.eval().requires_grad_(False)

    def save_pretrained(self, head_dir: str, dtype: torch.dtype | None = None) -> None:
        """fc + layer weights (in `dtype`, default the head's) and the id map; never the target's rows."""
        os.makedirs(head_dir, exist_ok=True)
        state = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in self.state_dict().items()}
        state[D2T_NAME] = self.d2t.cpu().contiguous()
        save_file(state, os.path.join(head_dir, WEIGHTS_NAME))
        self.config.save(head_dir)

    def init_from_target_layer(self, target_dir: str, index: int = -1) -> None:
        """Seed the decoder layer with one of the target's layers (HF tensor names)."""
        mc = ModelConfig.from_dir(target_dir)
        i = index % mc.num_layers
        names = {
            f"model.layers.{i}.{n}.weight": n
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        }
        t = read_target_tensors(target_dir, list(names))
        with torch.no_grad():
            for full, short in names.items():
                attr = short.split(".")[-1]
                p = getattr(self.layer, attr)
                (p if isinstance(p, nn.Parameter) else p.weight).copy_(t[full])

    # ----------------------------------------------------------------- compute

    def inputs(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """fc(cat(embed(tok_{t+1}), f_t)): [..., H]."""
        return self.fc(torch.cat((self.embed[tokens], feats.to(self.embed.dtype)), dim=-1))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, T, 1, D] for positions [B, T] (clamped: padding rows may run past the table)."""
        cos, sin = self.rotary(positions.clamp(0, self.rotary.cos.shape[0] - 1).reshape(-1))
        shape = (*positions.shape, 1, self.config.head_dim)
        dt = self.dtype
        return cos.view(shape).to(dt), sin.view(shape).to(dt)

    def forward(
        self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor | None = None, return_kv: bool = False
    ):
        """Full causal recompute over whole sequences: feats [B, T, H], tokens [B, T] -> f̂ [B, T, H]
        (row t predicts the feature at position t+1). The training path and the reference."""
        b, t = tokens.shape
        if positions is None:
            positions = torch.arange(t).expand(b, t)
        x = self.inputs(feats, tokens)
        q, k, v = self.layer.qkv(x, *self.rope(positions))
        out = self.layer.finish(x, q, k, v, None)
        return (out, k, v) if return_kv else out

    def draft_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """[..., N] logits over the draft vocabulary."""
        if self.packed_lm_head is not None:
            return self.packed_lm_head(feats)
        return feats @ self.lm_head.T

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def pack(self, quantization: str = "") -> "EagleHead":
        """Inference in bf16: every matmul through the serving path's packed weights (layers/quant.py:
        oneDNN's layout, and the native skinny kernels for the 1-4 rows a draft step has), which
        read the head's ~18 MB per draft step several times faster than plain bf16 F.linear.
        quantization "int8": int8 weights on the AMX path instead (half the bytes a draft step
        reads, a faster proposal: docs/benchmarks.md#fig-speculative), for a target served quantized."""
        if self.dtype != torch.bfloat16:  # (without oneDNN bf16, PackedWeight keeps dense weights)
            return self
        self.fc = PackedLinear(self.fc.weight, self.fc.bias, quantization)
        self.layer.pack(quantization)
        self.packed_lm_head = PackedLinear(self.lm_head, None, quantization)
        return self


class PackedLinear(nn.Module):
    """x @ W^T (+ b) over any leading dims, with W packed once (layers/quant.py PackedWeight, or
    QuantizedWeight for a weight-only `quantization`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, quantization: str = ""):
        from axonserve.neuron.layers.quant import PackedWeight, QuantizedWeight

        super().__init__()
        w = weight.detach()
        self.w = QuantizedWeight(w, quantization, w.dtype) if quantization else PackedWeight(w)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.w.matmul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.w.shape[0])
        return y if self.bias is None else y + self.bias


class DraftKV:
    """One request's head KV cache: dense K/V [Hkv, capacity, D], positions 0..length-1 valid."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32, capacity: int = 256):
        self.k = torch.zeros(num_kv_heads, capacity, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    @classmethod
    def for_head(cls, head: EagleHead, capacity: int = 256) -> "DraftKV":
        c = head.config
        return cls(c.num_kv_heads, c.head_dim, head.dtype, capacity)

    def crop(self, n: int) -> None:
        """Forget positions >= n (rejected speculative positions)."""
        self.length = min(self.length, max(0, n))

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set positions start..start+L-1 (k, v [Hkv, L, D]) and crop after them; grows by doubling."""
        if start > self.length:
            raise ValueError(f"write at {start} leaves a gap after {self.length} cached positions")
        end = start + k.shape[1]
        if end > self.k.shape[1]:
            cap = max(end, 2 * self.k.shape[1])
            nk = torch.zeros(self.k.shape[0], cap, self.k.shape[2], dtype=self.k.dtype)
            nv = torch.zeros_like(nk)
            nk[:, :start], nv[:, :start] = self.k[:, :start], self.v[:, :start]
            self.k, self.v = nk, nv
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        self.length = end


class ChainDrafts:
    """Greedy drafts of a batch of chains, one position per `add`; with min_prob > 0 each chain
    ends at (and keeps) the first draft whose draft probability is below it -- EAGLE-2's finding
    that the head's confidence tracks acceptance: confident chains run on to k, doubtful ones
    stop early and neither pay for further draft steps nor pad the verification."""

    def __init__(self, head: EagleHead, batch: int, k: int, min_prob: float = 0.0):
        self.head, self.k, self.min_prob = head, k, min_prob
        self.cols: list[torch.Tensor] = []
        self.length = torch.full((batch,), k, dtype=torch.long)
        self.alive = torch.ones(batch, dtype=torch.bool)

    def add(self, feature: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Draft from f̂ [B, H]: (target ids [B], whether another position is worth computing)."""
        logits = self.head.draft_logits(feature)
        if self.min_prob > 0:
            conf, idx = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            stop = self.alive & (conf < self.min_prob)
            self.length[stop] = len(self.cols) + 1
            self.alive &= ~stop
        else:
            idx = greedy_ids(logits)
        d = self.head.d2t[idx]
        self.cols.append(d)
        return d, len(self.cols) < self.k and bool(self.alive.any())

    def lists(self) -> list[list[int]]:
        if not self.cols:
            return [[] for _ in range(self.length.shape[0])]
        rows = torch.stack(self.cols, dim=1).tolist()
        return [r[:n] for r, n in zip(rows, self.length.tolist())]


@torch.inference_mode()
def propose(
    head: EagleHead,
    kvs: list[DraftKV],
    starts: list[int],
    tokens: list[torch.Tensor],
    feats: list[torch.Tensor],
    k: int,
    min_prob: float = 0.0,
) -> list[list[int]]:
    """Up to k greedy draft tokens (target ids) per request, batched over requests (k = 0: only
    extend the KV; min_prob: ChainDrafts).

    Request i: crop kvs[i] to starts[i], append its n_i new (feature, following token) pairs at
    positions starts[i]..starts[i]+n_i-1 (one padded catch-up pass for the batch), then k-1
    single-token steps feeding each predicted feature back with its drafted token. One dense
    KV buffer [B, Hkv, W, D] indexed by absolute position serves the whole call; a query at
    position p attends keys 0..p, so padding rows never reach a valid row.
    """
    b = len(kvs)
    if not (b == len(starts) == len(tokens) == len(feats)):
        raise ValueError("kvs, starts, tokens and feats must have one entry per request")
    if k < 0 or b == 0:
        return [[] for _ in range(b)]
    cfg, dt = head.config, head.dtype
    n = [int(t.shape[0]) for t in tokens]
    for i, kv in enumerate(kvs):
        if starts[i] > kv.length:
            raise ValueError(f"request {i}: start {starts[i]} is past its {kv.length} cached draft positions")
        if n[i] < 1 or feats[i].shape[0] != n[i]:
            raise ValueError(f"request {i}: needs n >= 1 tokens and as many features ({n[i]} vs {feats[i].shape[0]})")
        kv.crop(starts[i])
    nmax = max(n)
    extra = max(k - 1, 0)  # draft steps that feed a prediction back (k = 0: only the catch-up pass)
    width = max(starts) + nmax + extra
    kbuf = torch.zeros(b, cfg.num_kv_heads, width, cfg.head_dim, dtype=dt)
    vbuf = torch.zeros_like(kbuf)
    for i, kv in enumerate(kvs):
        kbuf[i, :, : starts[i]] = kv.k[:, : starts[i]]
        vbuf[i, :, : starts[i]] = kv.v[:, : starts[i]]
    start_t = torch.tensor(starts)
    n_t = torch.tensor(n)
    tok = torch.zeros(b, nmax, dtype=torch.long)
    fin = torch.zeros(b, nmax, cfg.hidden_size, dtype=dt)
    for i in range(b):
        tok[i, : n[i]] = tokens[i]
        fin[i, : n[i]] = feats[i].to(dt)
    rows = torch.arange(b)
    key_pos = torch.arange(width)

    def step(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, kk, vv = head.layer.qkv(x, *head.rope(pos))
        kbuf[rows[:, None], :, pos] = kk.transpose(1, 2)  # [B, T, Hkv, D] into positions pos
        vbuf[rows[:, None], :, pos] = vv.transpose(1, 2)
        mask = (key_pos[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, W]
        return head.layer.finish(x, q, kbuf, vbuf, mask)

    pos = start_t[:, None] + torch.arange(nmax)[None, :]  # padding rows land below width: max(starts)+nmax-1
    out = step(head.inputs(fin, tok), pos)
    last = out[rows, n_t - 1]  # [B, H]: f̂ at each request's first speculative position
    cur = start_t + n_t - 1  # position of the last input
    chains, more = ChainDrafts(head, b, k, min_prob), k > 0
    while more:
        d, more = chains.add(last)
        if more:
            cur = cur + 1
            last = step(head.inputs(last[:, None], d[:, None]), cur[:, None])[:, 0]
    end = (cur + 1).tolist()  # positions written: through the last draft step's input
    for i, kv in enumerate(kvs):
        kv.write(starts[i], kbuf[i, :, starts[i] : end[i]], vbuf[i, :, starts[i] : end[i]])
    return chains.lists()


def head_dir(model: str, served_name: str) -> str:
    """The `model` of --speculative-config, or the head shipped (or trained) for the served model."""
    if model:
        if not os.path.isfile(os.path.join(model, CONFIG_NAME)):
            raise ValueError(f"EAGLE head directory {model!r} holds no {CONFIG_NAME}")
        return model
    path = builtin_head_dir(served_name.removeprefix("HuggingFaceTB/"))
    if path is None:
        raise ValueError(
            f'no EAGLE head ships for {served_name!r}: pass "model": HEAD_DIR in --speculative-config '
            "(make one with `axonserve train-eagle`)"
        )
    return path


class EagleProposer:
    """The head, held by worker rank 0: each step it reads the target's hidden states where the
    forward left them (no copy to another process), extends the requests' head KV over the
    positions that became valid, and drafts for those asked.

    With the native kernels the head runs as a one-layer native stack over a paged head KV that
    shares the target's block tables (speculative/paged_draft.py); without them, through `propose` over one
    dense head KV per request. There, positions served from the target's prefix cache (and steps
    above disable_by_batch_size, which skip the head) leave gaps filled with zero keys/values
    (slightly lower acceptance, outputs unaffected: every draft is verified)."""

    def __init__(
        self,
        path: str,
        target_dir: str,
        dtype: torch.dtype = torch.float32,
        num_blocks: int = 0,
        block_size: int = 16,
        max_rows: int = 256,
        max_position: int = 0,
        quantization: str = "",
        min_prob: float = 0.0,
        tree: tuple[int, int] | None = None,
    ):
        """num_blocks: the target's KV pool (its block ids address the paged head KV); 0: dense path.
        quantization: the head's weight format (pack()). min_prob: ChainDrafts. tree: (width, depth)
        of EAGLE-2 draft trees (TreeDrafts; the paged path only: the dense one drafts chains of depth)."""
        self.head = EagleHead.from_pretrained(path, target_dir, dtype=dtype).pack(quantization)
        self.min_prob, self.tree = min_prob, tree
        self.kvs: dict[str, DraftKV] = {}
        self.paged = None
        if num_blocks:
            from axonserve.speculative.paged_draft import PagedDrafter

            scratch = max(16, tree[0] * (tree[1] - 1)) if tree else 16  # k <= 16
            self.paged = PagedDrafter.maybe(self.head, num_blocks, block_size, max_rows, max_position, scratch)

    @classmethod
    def from_config(
        cls, config: Any, dtype: torch.dtype = torch.float32, num_blocks: int = 0, max_position: int = 0
    ) -> "EagleProposer":
        spec = config.speculative
        # a target with quantized weights gets an int8 head (int4 would cost acceptance)
        return cls(
            head_dir(spec.model, config.served_model_name or config.model),
            config.model,
            dtype,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_rows=config.max_num_seqs,
            max_position=max_position,
            quantization="int8" if config.quantization else "",
            min_prob=spec.min_draft_confidence,
            tree=spec.tree,
        )

    def drop(self, rid: str) -> None:
        self.kvs.pop(rid, None)

    def propose(
        self,
        request_ids: list[str],
        starts: list[int],
        tokens: list[list[int]],
        feats: list[torch.Tensor],
        num_drafts: list[int],
        block_tables: list[list[int]] | None = None,
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        """Request i's positions starts[i].. got features feats[i] [n_i, H] and were followed by
        tokens[i] (n_i ids); returns num_drafts[i] drafts each (0: only the KV grows), and their
        parents when they are trees (None: chains). block_tables: the requests' target blocks (the
        paged path needs them)."""
        if not request_ids:
            return [], None
        paged = self.paged is not None and block_tables is not None
        # a tree while the nodes wanted outnumber its depth (paged path only); fewer (under load)
        # make a chain, which drafts them at a quarter of the rows, no longer than the depth
        tree = None
        if self.tree is not None and paged and max(num_drafts) > self.tree[1]:
            tree = (*self.tree, num_drafts)
        elif self.tree is not None:
            num_drafts = [min(m, self.tree[1]) for m in num_drafts]
        if paged:
            drafts, parents = self.paged.propose(
                block_tables, starts, tokens, feats, max(num_drafts), self.min_prob, tree
            )
            return [d[:m] for d, m in zip(drafts, num_drafts)], parents
        kvs = []
        for rid, start in zip(request_ids, starts):
            kv = self.kvs.get(rid)
            if kv is None:
                kv = self.kvs[rid] = DraftKV.for_head(self.head)
            if start > kv.length:  # a gap: prefix-cache hit, or steps that skipped the head
                zeros = torch.zeros(kv.k.shape[0], start - kv.length, kv.k.shape[2], dtype=kv.k.dtype)
                kv.write(kv.length, zeros, zeros)
            kvs.append(kv)
        drafts = propose(
            self.head,
            kvs,
            starts,
            [torch.tensor(t, dtype=torch.long) for t in tokens],
            feats,
            max(num_drafts),
            self.min_prob,
        )
        return [d[:m] for d, m in zip(drafts, num_drafts)], None


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax values [R, k] float32, indices [R, k]) of each row's k largest logits."""
    from axonserve.neuron.ops import native

    kernels = native.for_dtype(logits.dtype)
    if kernels is not None and hasattr(kernels, "topk_logprobs") and logits.stride(-1) == 1:
        return kernels.topk_logprobs(logits, k)
    top = logits.float().topk(k, dim=-1)
    return top.values - torch.logsumexp(logits.float(), dim=-1, keepdim=True), top.indices


class TreeDrafts:
    """EAGLE-2's dynamic draft tree for a batch (speculative/training/evaluate.py reference_tree is its
    reference): the root's `width` best tokens are depth 1; each further depth runs the head on
    the `width` best nodes of the depth before (by cumulative draft log-probability), each
    proposing its `width` best children; in the end the `budget` best nodes of the whole tree
    are verified. A child never scores above its parent, so the best nodes include their
    ancestors. Each expanded node's head K/V sits at a scratch position of its request; the
    rows of the next depth attend to the context plus the scratch positions on their path.
    The bookkeeping is plain Python over a few dozen nodes: as torch ops it cost a large share of
    a proposal (docs/benchmarks.md#fig-speculative)."""

    def __init__(self, head: EagleHead, root: torch.Tensor, width: int, depth: int, scratch: np.ndarray):
        """root: f̂ [B, H] at each request's last known position; scratch[i]: the first of request
        i's width * (depth - 1) scratch positions."""
        self.head, self.width, self.depth = head, width, depth
        self.scratch = [int(x) for x in scratch]
        b = root.shape[0]
        # per request, every candidate node: [target id, parent node (-1: root), score, depth, scratch path]
        self.nodes: list[list[list[Any]]] = [[] for _ in range(b)]
        self.level = self.expanded = 0
        self._children(root, [[(-1, 0.0, ())] for _ in range(b)])

    def _children(self, out: torch.Tensor, sources: list[list[tuple[int, float, tuple[int, ...]]]]) -> None:
        """Rows of f̂ `out` (request-major; sources[i]: request i's rows as (node, score, path)):
        each row's width best children become candidates, the width best of a request's next."""
        lps, top = topk_logprobs(self.head.draft_logits(out), self.width)
        lps, ids = lps.tolist(), self.head.d2t[top].tolist()
        self.level += 1
        self.out, self.frontier, self.rows = out, [], []
        row = 0
        for nodes, src in zip(self.nodes, sources):
            cands = []
            for parent, score, path in src:
                for lp, tok in zip(lps[row], ids[row]):
                    nodes.append([tok, parent, score + lp, self.level, path])
                    cands.append((len(nodes) - 1, row))
                row += 1
            best = sorted(cands, key=lambda c: -nodes[c[0]][2])[: self.width]
            self.frontier.append([j for j, _ in best])
            self.rows += [r for _, r in best]  # the row of `out` that is each frontier node's parent's f̂

    def more(self) -> bool:
        return self.level < self.depth

    def inputs(self) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
        """The frontier's rows for the head: (x [B*W, H], row depth [B*W], scratch slot position
        [B*W], keys past the context [B*W, D-1] (-1 pad)), rows request-major."""
        toks, slots = [], []
        extra = np.full((len(self.rows), max(self.depth - 1, 1)), -1, dtype=np.int64)
        for i, (nodes, front) in enumerate(zip(self.nodes, self.frontier)):
            for k, j in enumerate(front):
                node = nodes[j]
                node[4] = (*node[4], self.scratch[i] + self.expanded + k)
                extra[len(toks), : len(node[4])] = node[4]
                toks.append(node[0])
                slots.append(node[4][-1])
        self.expanded += self.width
        x = self.head.inputs(self.out[torch.tensor(self.rows)], torch.tensor(toks))
        return x, np.full(len(toks), self.level, dtype=np.int64), np.array(slots, dtype=np.int64), extra

    def grow(self, out: torch.Tensor) -> None:
        """f̂ [B*W, H] of the frontier rows just run: their children join the tree."""
        self._children(
            out, [[(j, nodes[j][2], nodes[j][4]) for j in front] for nodes, front in zip(self.nodes, self.frontier)]
        )

    def lists(self, budgets: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        """(draft tokens, parents) per request: its budget best nodes, by depth then creation."""
        toks, pars = [], []
        for nodes, budget in zip(self.nodes, budgets):
            best = sorted(range(len(nodes)), key=lambda j: -nodes[j][2])[:budget]
            keep = sorted(best, key=lambda j: (nodes[j][3], j))
            where = {j: n for n, j in enumerate(keep)}
            toks.append([nodes[j][0] for j in keep])
            pars.append([where.get(nodes[j][1], -1) for j in keep])
        return toks, pars

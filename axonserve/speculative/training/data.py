"""Self-distillation data for a draft head: the target's own text and its own features.

Text comes from axonserve's offline engine (continuous batching; greedy and temperature-0.8
sampling mixed). Features come from a teacher-forced forward of axonserve's own Llama over
each whole sequence through the paged-attention path the worker uses, so they are the very
post-final-norm states the serving worker hands the drafter.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import structlog
import torch
from tqdm import tqdm

from axonserve.speculative.training.prompts import Prompt

log = structlog.get_logger()


@dataclass
class Sequence:
    """One prompt + completion with the target's per-position features and greedy choices."""

    ids: torch.Tensor  # [T] long: prompt then completion
    prompt_len: int
    feats: torch.Tensor | None = None  # [T, H] post-final-norm hidden states (the recording model's dtype)
    argmax: torch.Tensor | None = None  # [T] long: the target's greedy next token at each position
    greedy: bool = True
    kind: str = ""


def encode_prompts(model_dir: str, prompts: list[Prompt]) -> list[list[int]]:
    """Token ids: chat prompts through the model's chat template when it has one, else raw text."""
    from axonserve.frontends.tokenizer import Tokenizer

    tok = Tokenizer.load(model_dir)
    out = []
    for p in prompts:
        if p.chat and tok.has_chat_template:
            out.append(tok.encode_chat([{"role": "user", "content": p.text}]))
        else:
            out.append(tok.encode(p.text))
    return out


def collect(
    model_dir: str,
    jobs: list[tuple[Prompt, float]],
    max_new_tokens: int,
    budget_s: float,
    chunk: int = 128,
    seed: int = 0,
    **engine_kwargs,
) -> list[Sequence]:
    """Run (prompt, temperature) jobs through the offline engine chunk by chunk, recording each
    chunk's features as it lands, until the next chunk would overrun the budget (both phases
    cost about the same on CPU, so the budget has to cover them together)."""
    from axonserve.config import resolve_dtype
    from axonserve.frontends.offline import LLM
    from axonserve.protocol.messages import SamplingParams

    ids = encode_prompts(model_dir, [p for p, _ in jobs])
    t0 = time.perf_counter()
    # the precision the engine serves by default (--dtype auto), so the head learns the features and
    # greedy choices it will be handed; bf16 is also faster than fp32 (feature passes dominated;
    # docs/benchmarks.md#fig-speculative-training)
    dtype = engine_kwargs.get("dtype", "auto")
    recorder = FeatureRecorder(model_dir, dtype=getattr(torch, resolve_dtype(model_dir) if dtype == "auto" else dtype))
    llm = LLM(model_dir, **engine_kwargs)
    seqs: list[Sequence] = []
    ntok, chunk_s = 0, 0.0
    try:
        bar = tqdm(total=len(jobs), desc="self-distil: generate + features", unit="seq")
        for s in range(0, len(jobs), chunk):
            if seqs and time.perf_counter() - t0 + chunk_s > budget_s:  # the next chunk would overrun
                log.info("eagle.data_budget_spent", done=s, queued=len(jobs))
                break
            c0 = time.perf_counter()
            part = list(range(s, min(s + chunk, len(jobs))))
            params = [SamplingParams(temperature=jobs[i][1], max_tokens=max_new_tokens, seed=seed + i) for i in part]
            new = []
            for i, out in zip(part, llm.generate([ids[i] for i in part], params)):
                comp = out.outputs[0].token_ids
                new.append(
                    Sequence(torch.tensor(ids[i] + comp), len(ids[i]), greedy=jobs[i][1] == 0, kind=jobs[i][0].kind)
                )
                ntok += len(comp)
            g_s = time.perf_counter() - c0
            recorder.record(new)
            seqs += new
            chunk_s = time.perf_counter() - c0
            bar.update(len(part))
            bar.set_postfix(new_tok=ntok, gen_s=round(g_s), feat_s=round(chunk_s - g_s), refresh=False)
        bar.close()
    finally:
        llm.shutdown()
    log.info("eagle.collected", seqs=len(seqs), new_tokens=ntok, seconds=round(time.perf_counter() - t0, 1))
    return seqs


class FeatureRecorder:
    """axonserve's model plus a scratch paged KV cache, for teacher-forced feature passes."""

    def __init__(
        self, model_dir: str, max_batch_tokens: int = 2048, block_size: int = 16, dtype: torch.dtype = torch.float32
    ):
        from axonserve.neuron.config import ModelConfig
        from axonserve.neuron.loader import load_model

        self.mc = ModelConfig.from_dir(model_dir)
        self.model = load_model(self.mc, dtype, progress=False)
        self.budget, self.block_size, self.dtype = max_batch_tokens, block_size, dtype
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _cache(self, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not self.kv or self.kv[0][0].shape[0] < blocks:
            shape = (blocks, self.block_size, self.mc.num_kv_heads, self.mc.head_dim)
            self.kv = [
                (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
                for _ in range(self.mc.num_layers)
            ]
        return self.kv

    @torch.inference_mode()
    def record(self, seqs: list[Sequence]) -> None:
        """Fill seq.feats / seq.argmax: whole sequences as prefill chunks of one flat batch, the
        runner's own path (AttentionMetadata.build, model forward, compute_logits)."""
        from axonserve.neuron.ops.attention import AttentionMetadata

        if not seqs:
            return
        longest = max(len(s.ids) for s in seqs)
        if longest > self.mc.max_position_embeddings:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds the model's {self.mc.max_position_embeddings} positions"
            )
        budget, bs = max(self.budget, longest), self.block_size
        kv = self._cache(budget // bs + len(seqs) + 1)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].ids))
        i = 0
        while i < len(order):
            batch, ntok = [], 0
            while i < len(order) and (not batch or ntok + len(seqs[order[i]].ids) <= budget):
                batch.append(seqs[order[i]])
                ntok += len(batch[-1].ids)
                i += 1
            lens = [len(s.ids) for s in batch]
            tables, nxt = [], 0
            for n in lens:
                tables.append(list(range(nxt, nxt + -(-n // bs))))
                nxt += len(tables[-1])
            meta = AttentionMetadata.build(lens, [0] * len(batch), tables, bs)
            hidden = self.model(torch.cat([s.ids for s in batch]), meta.positions, kv, meta)
            am = self.model.compute_logits(hidden).argmax(dim=-1)
            for s, h, a in zip(batch, hidden.split(lens), am.split(lens)):
                s.feats, s.argmax = h.clone(), a.clone()  # kept in the model's dtype: bf16 halves the cache


def draft_vocab(seqs: list[Sequence], size: int, vocab_size: int, always: list[int] = ()) -> torch.Tensor:
    """The `size` most frequent target output tokens (completions + greedy choices), sorted ids.

    `always` (EOS ids) is kept; when the data has fewer distinct tokens, the rest is filled with
    the most frequent prompt tokens, then the lowest unused ids."""
    out_counts: Counter[int] = Counter()
    prompt_counts: Counter[int] = Counter()
    for s in seqs:
        out_counts.update(s.ids[s.prompt_len :].tolist())
        if s.argmax is not None:
            out_counts.update(s.argmax[max(0, s.prompt_len - 1) :].tolist())
        prompt_counts.update(s.ids[: s.prompt_len].tolist())
    size = min(size, vocab_size)
    chosen = list(dict.fromkeys([t for t in always if 0 <= t < vocab_size]))
    seen = set(chosen)
    for t, _ in out_counts.most_common() + prompt_counts.most_common():
        if len(chosen) >= size:
            break
        if t not in seen:
            chosen.append(t)
            seen.add(t)
    if len(chosen) < size:
        rest = np.setdiff1d(np.arange(vocab_size), np.asarray(chosen, dtype=np.int64))[: size - len(chosen)]
        chosen += rest.tolist()
    return torch.tensor(sorted(chosen[:size]), dtype=torch.long)

"""`axonserve train-eagle`: self-distil a target into an EAGLE-1 draft head on CPU, within a time budget.

1. Generate: the target answers built-in prompts through axonserve's offline engine (each prompt
   once greedy, once at temperature 0.8).
2. Record features: a teacher-forced forward of axonserve's own model over every sequence, chunk
   by chunk as generation lands (on CPU it costs about as much as generating), both within
   `data_fraction` of the time budget.
3. Train (AdamW, warm-up + cosine over the remaining time): EAGLE-1 loss, smooth-L1 on the
   next feature + 0.1 x soft-label CE over the draft vocabulary, uniform noise on input
   features; optionally unrolled over `ttt_steps` chained predictions (EAGLE-3's training-time
   test) so drafts 2..k see their own predicted features as they will at inference.
4. Save the head; report validation top-1 and simulated acceptance (k=1..4, and confidence-stopped
   chains) as JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass

import structlog
import torch
import torch.nn.functional as F
from tqdm import tqdm

from axonserve.config import cpu_has_bf16
from axonserve.speculative.eagle import EagleHead, target_vocab_tensors
from axonserve.speculative.training.data import Sequence, collect, draft_vocab
from axonserve.speculative.training.evaluate import draft_step_latency, simulate_acceptance, simulate_tree_acceptance
from axonserve.speculative.training.prompts import held_out_prompts, training_prompts

log = structlog.get_logger()

REPORT_NAME = "eagle_report.json"


@dataclass
class TrainConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    batch_tokens: int = 1024  # loss tokens per optimiser step (about)
    max_len: int = 512  # longer sequences are cut
    ttt_steps: int = 1  # chained predictions trained per position (1 = plain EAGLE-1; 2 measured worse per CPU-minute)
    ttt_decay: float = 0.8  # weight of chained step j is decay**(j-1)
    ce_weight: float = 0.1
    noise: float = 0.1  # uniform noise half-width on input features
    grad_clip: float = 0.5
    seed: int = 0
    # bf16 autocast where the CPU has native bf16 (weights and AdamW state stay fp32): more optimiser
    # steps per CPU-minute (docs/benchmarks.md#fig-speculative-training), and data, not precision, is
    # what the head lacks
    mixed_precision: bool = True


@dataclass
class Batch:
    feats: torch.Tensor  # [B, L+1, H] f_0..f_L
    ids: torch.Tensor  # [B, L+1] tokens at positions 0..L (input at p is ids[p+1])
    argmax: torch.Tensor  # [B, L+1] the target's greedy choice at each position
    first: torch.Tensor  # [B] first loss position (prompt_len - 1)
    last: torch.Tensor  # [B] last valid input position (T - 2)


def make_batch(seqs: list[Sequence], max_len: int) -> Batch:
    lens = [min(len(s.ids), max_len) for s in seqs]
    width = max(lens)
    h = seqs[0].feats.shape[1]
    b = len(seqs)
    feats = torch.zeros(b, width, h)
    ids = torch.zeros(b, width, dtype=torch.long)
    am = torch.zeros(b, width, dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, lens)):
        feats[i, :n], ids[i, :n], am[i, :n] = s.feats[:n], s.ids[:n], s.argmax[:n]
    return Batch(feats, ids, am, torch.tensor([s.prompt_len - 1 for s in seqs]), torch.tensor(lens) - 2)


def batches(seqs: list[Sequence], batch_tokens: int, max_len: int, rng: random.Random) -> list[list[Sequence]]:
    """Shuffled groups of about batch_tokens loss tokens."""
    order = seqs[:]
    rng.shuffle(order)
    out, cur, n = [], [], 0
    for s in order:
        cur.append(s)
        n += min(len(s.ids), max_len) - s.prompt_len
        if n >= batch_tokens:
            out.append(cur)
            cur, n = [], 0
    if cur:
        out.append(cur)
    return out


def chain_mask(length: int, j: int) -> torch.Tensor:
    """[L, j*L] keys for chained step j: a query at p sees step-1 keys at positions <= p-j+1 (the
    true context its chain starts from) and, from each step i=2..j, only the key at p-j+i (the
    chain's own speculative positions) -- what the draft KV holds when drafting token j."""
    p = torch.arange(length)[:, None]
    s = torch.arange(length)[None, :]
    blocks = [s <= p - j + 1] + [s == p - j + i for i in range(2, j + 1)]
    return torch.cat(blocks, dim=1)


def unrolled(head: EagleHead, batch: Batch, steps: int, noise: float = 0.0) -> list[torch.Tensor]:
    """Predicted features [B, L, H] of chained steps 1..steps; row p of step j predicts f_{p+1}
    from a chain that started at true position p-j+1."""
    f_in, tok = batch.feats[:, :-1], batch.ids[:, 1:]
    if noise:
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * noise
    length = tok.shape[1]
    cos, sin = head.rope(torch.arange(length).expand(tok.shape[0], length))
    outs, ks, vs = [], [], []
    x = head.inputs(f_in, tok)
    for j in range(1, steps + 1):
        if j > 1:  # input at p: the prediction of f_p made at p-1 in the previous step
            prev = outs[-1]
            x = head.inputs(torch.cat((torch.zeros_like(prev[:, :1]), prev[:, :-1]), dim=1), tok)
        q, k, v = head.layer.qkv(x, cos, sin)
        ks.append(k)
        vs.append(v)
        mask = None if j == 1 else chain_mask(length, j)[None, None]
        outs.append(head.layer.finish(x, q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), mask))
    return outs


def step_mask(batch: Batch, j: int) -> torch.Tensor:
    """[B, L] positions p whose chained step-j prediction counts: chain start p-j+1 >= first, p <= last."""
    p = torch.arange(batch.ids.shape[1] - 1)[None, :]
    return (p - j + 1 >= batch.first[:, None]) & (p <= batch.last[:, None])


def loss_and_hits(head: EagleHead, batch: Batch, cfg: TrainConfig, train: bool):
    """(loss, [(hits, count)] per chained step); hits: draft argmax == the target's greedy token."""
    outs = unrolled(head, batch, cfg.ttt_steps, cfg.noise if train else 0.0)
    target = batch.feats[:, 1:]
    label = batch.argmax[:, 1:]
    total, stats = 0.0, []
    for j, out in enumerate(outs, start=1):
        m = step_mask(batch, j)
        if not m.any():
            stats.append((0, 0))
            continue
        pred, tgt = out[m], target[m]
        logits = head.draft_logits(pred)
        with torch.no_grad():
            teacher = torch.softmax(head.draft_logits(tgt), dim=-1)
        loss = F.smooth_l1_loss(pred, tgt) + cfg.ce_weight * -(teacher * torch.log_softmax(logits, -1)).sum(-1).mean()
        total = total + cfg.ttt_decay ** (j - 1) * loss
        hits = int((head.d2t[logits.argmax(-1)] == label[m]).sum())
        stats.append((hits, int(m.sum())))
    return total, stats


@torch.no_grad()
def top1(head: EagleHead, seqs: list[Sequence], cfg: TrainConfig) -> list[float]:
    """Teacher-forced top-1 agreement with the target's greedy token, per chained step."""
    acc = [[0, 0] for _ in range(cfg.ttt_steps)]
    for group in batches(seqs, 4 * cfg.batch_tokens, cfg.max_len, random.Random(0)):
        _, stats = loss_and_hits(head, make_batch(group, cfg.max_len), cfg, train=False)
        for a, (h, n) in zip(acc, stats):
            a[0] += h
            a[1] += n
    return [h / max(n, 1) for h, n in acc]


def lr_at(cfg: TrainConfig, step: int, frac: float) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    cos = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return cfg.lr * warm * cos


def train_head(
    head: EagleHead,
    seqs: list[Sequence],
    val: list[Sequence],
    cfg: TrainConfig,
    budget_s: float,
    max_steps: int | None = None,
    watch_every: int = 500,
) -> dict:
    """Train fc + layer in place until the time budget (or max_steps) is spent; returns history (every
    50 steps), with teacher-forced top-1 on `val` every `watch_every` (a multiple of 50; overfitting shows there)."""
    head.train().requires_grad_(True)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(cfg.seed)
    amp = cfg.mixed_precision and cpu_has_bf16()
    t0 = time.perf_counter()
    step, epoch, hist = 0, 0, []
    bar = tqdm(total=round(budget_s), desc="train eagle head", unit="s")
    done = False
    while not done:
        epoch += 1
        for group in batches(seqs, cfg.batch_tokens, cfg.max_len, rng):
            frac = (time.perf_counter() - t0) / budget_s
            if frac >= 1.0 or (max_steps is not None and step >= max_steps):
                done = True
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, step, frac)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss, stats = loss_and_hits(head, make_batch(group, cfg.max_len), cfg, train=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            h, n = stats[0]
            lv = loss.item()
            bar.set_postfix(step=step, epoch=epoch, loss=f"{lv:.3f}", top1=f"{h / max(n, 1):.3f}", refresh=False)
            bar.update(round(time.perf_counter() - t0) - bar.n)
            if step % 50 == 0:
                rec = {
                    "step": step,
                    "seconds": round(time.perf_counter() - t0, 1),
                    "loss": round(lv, 4),
                    "train_top1_batch": round(h / max(n, 1), 4),
                }
                if val and step % watch_every == 0:
                    rec["val_top1"] = round(top1(head.eval(), val[:128], cfg)[0], 4)
                    head.train()
                    log.info("eagle.progress", **rec)
                hist.append(rec)
    bar.close()
    head.eval().requires_grad_(False)
    return {"steps": step, "epochs": epoch, "seconds": round(time.perf_counter() - t0, 1), "history": hist}


def split_by_prompt(seqs: list[Sequence], val_fraction: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """(val, train): whole prompts go to one side, so the greedy and sampled answers to one prompt
    (which share their opening) never sit on both sides and inflate validation top-1. A prompt's
    side follows from its hash alone, so adding a data cache (or resuming a head) never moves an
    earlier prompt across; at least one prompt is held out when there are two."""

    def rank(key: bytes) -> float:
        return (
            int.from_bytes(hashlib.blake2b(key, digest_size=8, salt=seed.to_bytes(8, "little")).digest(), "little")
            / 2**64
        )

    groups: dict[bytes, list[Sequence]] = {}
    for s in seqs:
        groups.setdefault(s.ids[: s.prompt_len].numpy().astype("<i8").tobytes(), []).append(s)
    ranks = {k: rank(k) for k in groups}
    held = {k for k, r in ranks.items() if r < val_fraction}
    if not held and len(groups) > 1:
        held = {min(ranks, key=ranks.get)}
    val = [s for k in groups if k in held for s in groups[k]]
    train = [s for k in groups if k not in held for s in groups[k]]
    return val, train or val


def make_jobs(num_prompts: int | None, seed: int, first: int = 0) -> list:
    """Each training prompt (from the first-th on) twice: greedy and temperature 0.8, interleaved
    so a budget cut keeps both."""
    ps = training_prompts(seed)[first:][:num_prompts]
    return [(p, t) for p in ps for t in (0.0, 0.8)]


def load_data(paths: list[str]) -> tuple[list[Sequence], list[Sequence], float]:
    """Training sequences of every cache (a sequence in several is kept once), held-out ones of
    the first, and the data seconds they cost together."""
    train, seen, evals, secs = [], set(), [], 0.0
    for i, path in enumerate(paths):
        data = torch.load(path, weights_only=False)
        for s in data["train"]:
            key = tuple(s.ids.tolist())
            if key not in seen:
                seen.add(key)
                train.append(s)
        evals = evals if i else data["eval"]
        secs += data["gen_seconds"]
        log.info("eagle.data_cache_loaded", path=path, seqs=len(data["train"]), kept_total=len(train))
    return train, evals, secs


def train_eagle(
    model: str,
    out: str,
    time_budget: float = 900.0,
    num_prompts: int | None = None,
    draft_vocab_size: int = 8192,
    max_new_tokens: int = 160,
    data_fraction: float = 0.5,
    num_eval_prompts: int | None = None,
    eval_max_new_tokens: int = 128,
    init: str = "random",
    val_fraction: float = 0.08,
    cfg: TrainConfig | None = None,
    data_cache: str = "",
    max_steps: int | None = None,
    save_dtype: str = "bfloat16",
    latency: bool = True,
    first_prompt: int = 0,
    resume: str = "",
    trees: tuple[tuple[int, int, int], ...] = (),
    **engine_kwargs,
) -> dict:
    """The whole pipeline; returns (and writes next to the head) the report. `resume`: go on
    training the head in that directory (its draft vocabulary kept) instead of a fresh one, so a
    new data cache adds to earlier training rather than repeating it. `trees`: (depth, width,
    budget) tree shapes whose simulated acceptance the report adds (minutes each on CPU)."""
    from axonserve.neuron.config import ModelConfig
    from axonserve.neuron.model_source import resolve_model

    cfg = cfg or TrainConfig()
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    model_dir = resolve_model(model)
    mc = ModelConfig.from_dir(model_dir)
    caches = [p for p in data_cache.split(",") if p]
    missing = [p for p in caches if not os.path.exists(p)]
    if len(caches) > 1 and missing:
        raise ValueError(f"data caches {missing} do not exist (only a single --data-cache path is generated)")
    if caches and not missing:
        seqs, evals, gen_s = load_data(caches)
    else:
        held = held_out_prompts()[:num_eval_prompts]
        jobs = [(p, 0.0) for p in held] + make_jobs(num_prompts, cfg.seed, first_prompt)
        seqs = collect(model_dir, jobs, max_new_tokens, time_budget * data_fraction, seed=cfg.seed, **engine_kwargs)
        evals, seqs = seqs[: len(held)], seqs[len(held) :]
        for s in evals:  # held-out continuations are as long as eval asks; generation used max_new_tokens
            s.ids, s.feats, s.argmax = (x[: s.prompt_len + eval_max_new_tokens] for x in (s.ids, s.feats, s.argmax))
        gen_s = time.perf_counter() - t_start
        if caches:
            torch.save({"train": seqs, "eval": evals, "gen_seconds": gen_s}, caches[0])
    if not seqs:
        raise ValueError("no training sequences were generated within the time budget; raise --time-budget")
    val, train = split_by_prompt(seqs, val_fraction, cfg.seed)
    if init not in ("random", "last"):
        raise ValueError(f"init {init!r}: expected random or last")
    if resume:
        head = EagleHead.from_pretrained(resume, model_dir)
        d2t = head.d2t
    else:
        d2t = draft_vocab(train, draft_vocab_size, mc.vocab_size, mc.eos_token_ids)
        head = EagleHead.from_target(model_dir, d2t, target_model=model)
        if init == "last":
            head.init_from_target_layer(model_dir, -1)
    val_top1_init = top1(head, val, cfg) if val else []
    budget = max(1.0, time_budget - (time.perf_counter() - t_start))
    result = train_head(head, train, val, cfg, budget, max_steps=max_steps)
    head.save_pretrained(out, dtype=getattr(torch, save_dtype))
    report = {
        "model": model,
        "model_dir": model_dir,
        "head_dir": os.path.abspath(out),
        "init": f"resumed from {resume}" if resume else init,
        "config": asdict(cfg),
        "draft_vocab_size": len(d2t),
        "data": {
            "train_seqs": len(train),
            "val_seqs": len(val),
            "eval_seqs": len(evals),
            "train_tokens": sum(len(s.ids) for s in train),
            "train_generated_tokens": sum(len(s.ids) - s.prompt_len for s in train),
            "greedy_fraction": sum(s.greedy for s in train) / len(train),
            "gen_and_feature_seconds": round(gen_s, 1),
        },
        "train": result,
        "val_top1_init": val_top1_init,
        "val_top1": top1(head, val, cfg) if val else [],
        "head_bytes": os.path.getsize(os.path.join(out, "model.safetensors")),
    }
    if evals:
        report["acceptance"] = [simulate_acceptance(head, evals, k) for k in (1, 2, 3, 4)]
        # chains of up to 6 stopped by the head's confidence (--speculative-config min_draft_confidence)
        report["acceptance_by_confidence"] = [simulate_acceptance(head, evals, 6, min_prob=p) for p in (0.2, 0.4, 0.6)]
        if trees:
            report["tree_acceptance"] = [simulate_tree_acceptance(head, evals, *t) for t in trees]
    if latency:
        _, lm = target_vocab_tensors(model_dir, mc.tie_word_embeddings)
        sizes = sorted({min(n, mc.vocab_size) for n in (1024, len(d2t), 16384, mc.vocab_size)})
        report["draft_step_ms"] = draft_step_latency(head, lm, sizes)
    report["total_seconds"] = round(time.perf_counter() - t_start, 1)
    with open(os.path.join(out, REPORT_NAME), "w") as f:
        json.dump(report, f, indent=2)
    log.info(
        "eagle.trained",
        out=out,
        val_top1=report["val_top1"],
        mean_accepted_length=[a["mean_accepted_length"] for a in report.get("acceptance", [])],
    )
    return report

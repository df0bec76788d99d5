"""EAGLE head: layer math against transformers, propose() and its KV against a full recompute,
save/load round trip with only the head's own tensors on disk."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from axonserve.speculative.eagle import CONFIG_NAME, WEIGHTS_NAME, DraftKV, EagleHead, propose

DRAFT_VOCAB = 512


def make_head(target_dir: str, seed: int = 0) -> EagleHead:
    g = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(49152, generator=g)[:DRAFT_VOCAB].sort().values
    torch.manual_seed(seed)
    head = EagleHead.from_target(target_dir, d2t).eval()
    with torch.no_grad():  # norms away from 1 so a missed norm weight shows
        head.layer.input_layernorm.uniform_(0.5, 1.5)
        head.layer.post_attention_layernorm.uniform_(0.5, 1.5)
    return head


def reference_chain(head: EagleHead, feats: torch.Tensor, toks: torch.Tensor, k: int, min_prob: float = 0.0):
    """k drafts by full causal recompute from scratch at every step (no cache): (ids, all inputs);
    min_prob: the chain ends with the first draft the head gives less probability."""
    f, t, out = feats.clone(), toks.clone(), []
    with torch.no_grad():
        for _ in range(k):
            y = head(f[None], t[None])[0, -1]
            probs = torch.softmax(head.draft_logits(y), dim=-1)
            d = head.d2t[probs.argmax()]
            out.append(int(d))
            if probs.max() < min_prob:
                break
            f, t = torch.cat((f, y[None])), torch.cat((t, d[None]))
    return out, f, t


def test_layer_equals_transformers_decoder_layer(tiny_llama_dir):
    """Seeded from the target's last layer, the head's layer is that Llama layer: same output as
    transformers' LlamaDecoderLayer (RMSNorm, GQA, RoPE at absolute positions, SwiGLU)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    head = make_head(tiny_llama_dir)
    head.init_from_target_layer(tiny_llama_dir, -1)
    layer = hf.model.layers[-1]
    with torch.no_grad():  # the checkpoint's norms are all ones: make them count
        for ours, theirs in (
            (head.layer.input_layernorm, layer.input_layernorm.weight),
            (head.layer.post_attention_layernorm, layer.post_attention_layernorm.weight),
        ):
            theirs.uniform_(0.5, 1.5)
            ours.copy_(theirs)
    x = torch.randn(2, 11, 64)
    pos = torch.arange(5, 16).expand(2, 11)
    with torch.no_grad():
        q, k, v = head.layer.qkv(x, *head.rope(pos))
        ours = head.layer.finish(x, q, k, v, None)
        cos, sin = hf.model.rotary_emb(x, pos)
        ref = layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
        ref = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_vocab_rows_are_the_targets(tiny_llama_dir):
    head = make_head(tiny_llama_dir)
    from axonserve.neuron.loader import safetensors_files

    with safe_open(safetensors_files(tiny_llama_dir)[0], framework="pt") as h:
        emb, lm = h.get_tensor("model.embed_tokens.weight"), h.get_tensor("lm_head.weight")
    assert torch.equal(head.embed, emb)
    assert torch.equal(head.lm_head, lm[head.d2t])  # untied target: lm_head rows, not embedding rows
    assert not torch.equal(head.lm_head, emb[head.d2t])


@pytest.mark.parametrize("k", [0, 1, 4])
def test_propose_matches_full_recompute(tiny_llama_dir, k):
    """Three requests with different context and catch-up lengths over three rounds (each round
    crops the previous round's speculative positions): drafts equal a from-scratch recompute, and
    the cached K/V equal the full recompute's K/V at every cached position (k = 0: the worker's
    steps that only extend the head's KV)."""
    head = make_head(tiny_llama_dir)
    torch.manual_seed(1)
    lens = [40, 23, 31]
    feats = [torch.randn(n, 64) for n in lens]
    toks = [torch.randint(0, 49152, (n,)) for n in lens]
    rounds = [[9, 1, 17], [3, 5, 1], [1, 4, 2]]  # n_i per round: prefill, then accepted+1
    kvs = [DraftKV.for_head(head, capacity=4) for _ in lens]  # tiny capacity: growth is exercised
    done = [0, 0, 0]
    for ns in rounds:
        starts = list(done)
        got = propose(
            head,
            kvs,
            starts,
            [toks[i][s : s + n] for i, (s, n) in enumerate(zip(starts, ns))],
            [feats[i][s : s + n] for i, (s, n) in enumerate(zip(starts, ns))],
            k,
        )
        for i, n in enumerate(ns):
            done[i] += n
            want, f_all, t_all = reference_chain(head, feats[i][: done[i]], toks[i][: done[i]], k)
            assert got[i] == want, (i, got[i], want)
            assert kvs[i].length == done[i] + max(k - 1, 0)  # valid positions + the k-1 speculative inputs
            with torch.no_grad():
                _, kf, vf = head(f_all[None, : kvs[i].length], t_all[None, : kvs[i].length], return_kv=True)
            torch.testing.assert_close(kvs[i].k[:, : kvs[i].length], kf[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kvs[i].v[:, : kvs[i].length], vf[0], atol=1e-5, rtol=1e-5)


def confident_head(target_dir: str) -> EagleHead:
    """A random head whose draft probabilities spread over ~0.05-0.9 (a random one's are ~1/400),
    so a confidence threshold cuts some chains and not others."""
    head = make_head(target_dir)
    head.lm_head = head.lm_head * 50.0  # sharper logits
    return head


def test_confidence_stopped_chains_match_a_recompute(tiny_llama_dir):
    """min_prob ends each request's chain at its first doubtful draft (kept), the others run on to k;
    over rounds (each cropping the last round's speculative positions) the drafts equal a recompute."""
    head = confident_head(tiny_llama_dir)
    torch.manual_seed(3)
    lens = [40, 23, 31, 28]
    feats = [torch.randn(n, 64) for n in lens]
    toks = [torch.randint(0, 49152, (n,)) for n in lens]
    kvs = [DraftKV.for_head(head) for _ in lens]
    done, seen = [0] * 4, set()
    for ns in ([9, 1, 17, 5], [3, 5, 1, 2], [1, 4, 2, 3]):
        starts = list(done)
        got = propose(
            head,
            kvs,
            starts,
            [toks[i][s : s + n] for i, (s, n) in enumerate(zip(starts, ns))],
            [feats[i][s : s + n] for i, (s, n) in enumerate(zip(starts, ns))],
            5,
            min_prob=0.1,
        )
        for i, n in enumerate(ns):
            done[i] += n
            assert got[i] == reference_chain(head, feats[i][: done[i]], toks[i][: done[i]], 5, 0.1)[0]
            seen.add(len(got[i]))
    assert len(seen) >= 3, seen  # chains of several lengths, so the threshold really cut


def test_propose_rejects_a_gap(tiny_llama_dir):
    head = make_head(tiny_llama_dir)
    kv = DraftKV.for_head(head)
    with pytest.raises(ValueError, match="past its 0 cached"):
        propose(head, [kv], [3], [torch.tensor([1])], [torch.zeros(1, 64)], 2)


def test_save_load_round_trip(tiny_llama_dir, tmp_path):
    head = make_head(tiny_llama_dir)
    head.save_pretrained(str(tmp_path))
    with safe_open(os.path.join(tmp_path, WEIGHTS_NAME), framework="pt") as h:
        names = set(h.keys())
    assert "d2t" in names and "fc.weight" in names and "layer.q_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)  # target rows are never saved
    cfg = json.load(open(os.path.join(tmp_path, CONFIG_NAME)))
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_vocab_size"] == 49152
    loaded = EagleHead.from_pretrained(str(tmp_path), tiny_llama_dir)
    assert torch.equal(loaded.d2t, head.d2t)
    f, t = torch.randn(1, 7, 64), torch.randint(0, 49152, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(f, t), head(f, t))
    # bf16 on disk (the shipped form), loaded back in bf16: propose still runs and agrees closely
    head.save_pretrained(str(tmp_path / "bf16"), dtype=torch.bfloat16)
    assert os.path.getsize(tmp_path / "bf16" / WEIGHTS_NAME) < 0.6 * os.path.getsize(tmp_path / WEIGHTS_NAME)
    lb = EagleHead.from_pretrained(str(tmp_path / "bf16"), tiny_llama_dir, dtype=torch.bfloat16)
    out = propose(lb, [DraftKV.for_head(lb)], [0], [t[0]], [f[0]], 3)
    assert len(out[0]) == 3 and all(0 <= x < 49152 for x in out[0])
    # packed for serving (what worker rank 0 runs in bf16): the same head within bf16 rounding
    packed = EagleHead.from_pretrained(str(tmp_path / "bf16"), tiny_llama_dir, dtype=torch.bfloat16).pack()
    from axonserve.neuron.layers.quant import can_pack
    from axonserve.speculative.eagle import PackedLinear

    assert isinstance(packed.layer.packed_gate_up, PackedLinear)  # oneDNN's layout where the CPU has it
    assert packed.layer.packed_gate_up.w.onednn == can_pack(torch.bfloat16)
    with torch.no_grad():
        for rows in (1, 7):  # the skinny-matmul path and oneDNN's
            y, yp = lb(f[:, :rows].bfloat16(), t[:, :rows]), packed(f[:, :rows].bfloat16(), t[:, :rows])
            torch.testing.assert_close(yp.float(), y.float(), atol=0.05, rtol=0.05)
            torch.testing.assert_close(
                packed.draft_logits(yp).float(), lb.draft_logits(yp).float(), atol=0.05, rtol=0.05
            )


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_worker_drafts_equal_a_recompute_from_the_targets_features(tmp_path, smollm2_dir, shape):
    """Worker rank 0's in-step EAGLE (ModelRunner + EagleProposer) on a 16-token model: chunked
    prefill, then decode steps that verify the previous step's drafts (a 16-token vocabulary
    makes some get accepted, some rejected): 3-token chains, or EAGLE-2 trees 3 wide, 3 deep,
    6 nodes. After every step the drafts must equal a from-scratch recompute over transformers'
    features of the whole valid sequence: the rows, positions and following tokens handed to the
    head line up (a tree's accepted path's too), and rejected positions are cropped from its KV.
    Tree paths off the first branch get accepted, their K/V moved into place, and every token is
    the target's greedy choice given the ones before it (so the moved K/V is what later steps read)."""
    from conftest import make_tiny_model
    from transformers import AutoModelForCausalLM

    from axonserve.config import EngineConfig, SpeculativeConfig
    from axonserve.neuron.model_runner import ModelRunner
    from axonserve.protocol.messages import CachedRequestData, NewRequestData, SamplingParams, StepPlan
    from axonserve.speculative.training.evaluate import reference_tree
    from axonserve.speculative.tree import tree_path

    target = make_tiny_model(str(tmp_path / "target"), "LlamaForCausalLM", smollm2_dir, seed=5, vocab_size=16)
    torch.manual_seed(0)
    head_dir = str(tmp_path / "head")
    EagleHead.from_target(target, torch.arange(16)).save_pretrained(head_dir)
    head = EagleHead.from_pretrained(head_dir, target)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    k = 3 if shape == "chain" else 6
    spec = SpeculativeConfig(method="eagle", model=head_dir, num_speculative_tokens=k, tree_width=3, tree_depth=3)
    runner = ModelRunner(EngineConfig(model=target, block_size=4, num_kv_blocks=64, threads=2, speculative=spec))

    prompt = [int(t) for t in torch.randint(0, 16, (13,), generator=torch.Generator().manual_seed(2))]
    tokens, computed, drafts, parents = list(prompt), 0, [], []
    accepted = rejected = moved = 0
    params = SamplingParams(temperature=0.0)
    have: list[int] = []  # KV blocks the runner already holds for "r"
    for step in range(30):
        n = min(5, len(tokens) - computed) + len(drafts)
        ends = computed + n >= len(tokens)  # samples at the end of this step: drafts are asked for
        blocks = list(range(-(-(computed + n) // 4)))
        if step == 0:
            plan_req = dict(new=[NewRequestData("r", list(tokens), len(tokens), blocks, 0, params)])
        else:
            plan_req = dict(cached=[CachedRequestData("r", blocks[len(have) :])])
        have = blocks
        plan = StepPlan(
            step,
            num_scheduled_tokens=[n],
            draft_token_ids={"r": drafts} if drafts else {},
            draft_parents={"r": parents} if drafts and shape == "tree" else {},
            want_features=True,
            num_drafts={"r": k} if ends else {},
            **plan_req,
        )
        res = runner.execute(plan)
        assert res.error is None, res.error
        got = res.sampled_token_ids
        if drafts:
            path = tree_path(drafts, parents, got)
            accepted, rejected = accepted + len(path), rejected + len(drafts) - len(path)
            moved += path != list(range(len(path)))
            computed += len(got)
        else:
            computed += n
        tokens += got
        drafts = dict(zip(res.draft_request_ids, res.draft_token_ids)).get("r", [])
        parents = dict(zip(res.draft_request_ids, res.draft_parents)).get("r", list(range(-1, len(drafts) - 1)))
        if not ends:
            assert drafts == []
            continue
        with torch.no_grad():
            feats = hf(torch.tensor([tokens[:computed]]), output_hidden_states=True).hidden_states[-1][0]
        follow = torch.tensor(tokens[1 : computed + 1])
        if shape == "chain":
            assert not res.draft_parents and drafts == reference_chain(head, feats, follow, 3)[0], step
        else:
            assert (drafts, parents) == reference_tree(head, feats, follow, 3, 3, 6), step
    assert accepted > 0 and rejected > 0 and (moved > 0) == (shape == "tree"), (accepted, rejected, moved)
    with torch.no_grad():
        greedy = hf(torch.tensor([tokens[:-1]])).logits[0].argmax(-1)
    assert tokens[len(prompt) :] == greedy[len(prompt) - 1 :].tolist()

"""EAGLE head: layer math against transformers, propose() and its KV against a full recompute,
save/load round trip with only the head's own tensors on disk."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from axonserve.spec.eagle import CONFIG_NAME, WEIGHTS_NAME, DraftKV, EagleHead, propose

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


def reference_chain(head: EagleHead, feats: torch.Tensor, toks: torch.Tensor, k: int):
    """k drafts by full causal recompute from scratch at every step (no cache): (ids, all inputs)."""
    f, t, out = feats.clone(), toks.clone(), []
    with torch.no_grad():
        for _ in range(k):
            y = head(f[None], t[None])[0, -1]
            d = head.d2t[head.draft_logits(y).argmax()]
            out.append(int(d))
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
        for ours, theirs in ((head.layer.input_layernorm, layer.input_layernorm.weight),
                             (head.layer.post_attention_layernorm, layer.post_attention_layernorm.weight)):
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


@pytest.mark.parametrize("k", [1, 4])
def test_propose_matches_full_recompute(tiny_llama_dir, k):
    """Three requests with different context and catch-up lengths over three rounds (each round
    crops the previous round's speculative positions): drafts equal a from-scratch recompute, and
    the cached K/V equal the full recompute's K/V at every cached position."""
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
        got = propose(head, kvs, starts, [toks[i][s:s + n] for i, (s, n) in enumerate(zip(starts, ns))],
                      [feats[i][s:s + n] for i, (s, n) in enumerate(zip(starts, ns))], k)
        for i, n in enumerate(ns):
            done[i] += n
            want, f_all, t_all = reference_chain(head, feats[i][: done[i]], toks[i][: done[i]], k)
            assert got[i] == want, (i, got[i], want)
            assert kvs[i].length == done[i] + k - 1  # valid positions + the k-1 speculative inputs
            with torch.no_grad():
                _, kf, vf = head(f_all[None, : kvs[i].length], t_all[None, : kvs[i].length], return_kv=True)
            torch.testing.assert_close(kvs[i].k[:, : kvs[i].length], kf[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kvs[i].v[:, : kvs[i].length], vf[0], atol=1e-5, rtol=1e-5)


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

"""train-eagle end to end on a tiny random Llama: generation through the engine, features from
axonserve's model, training, saving, loading, proposing; and training must actually help."""

from __future__ import annotations

import json
import os

import pytest
import torch

from axonserve.cli import main
from axonserve.speculative.eagle import DraftKV, EagleHead, propose
from axonserve.speculative.training.data import Sequence
from axonserve.speculative.training.train import REPORT_NAME, TrainConfig, split_by_prompt, top1


@pytest.fixture(scope="module")
def trained(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle")
    with pytest.raises(SystemExit) as e:
        main(
            [
                "train-eagle",
                tiny_llama_dir,
                "--out",
                str(out / "head"),
                "--time-budget",
                "50",
                "--lr",
                "3e-3",
                "--num-prompts",
                "8",
                "--num-eval-prompts",
                "3",
                "--draft-vocab",
                "512",
                "--max-new-tokens",
                "40",
                "--batch-tokens",
                "256",
                "--data-cache",
                str(out / "data.pt"),
                "--no-latency",
                "--tree-report",
                "3x1x3,3x3x5",
            ]
        )
    assert e.value.code == 0
    return str(out / "head"), torch.load(out / "data.pt", weights_only=False)


def test_report_and_files(trained):
    head_dir, data = trained
    assert sorted(os.listdir(head_dir)) == ["eagle_config.json", REPORT_NAME, "model.safetensors"]
    r = json.load(open(os.path.join(head_dir, REPORT_NAME)))
    assert r["draft_vocab_size"] == 512 and r["data"]["train_seqs"] + r["data"]["val_seqs"] == 16
    # training stops inside the budget left after generating data (the total adds evaluation, whose
    # time depends on the machine and its load)
    assert r["train"]["seconds"] <= 50 and r["train"]["steps"] > 10
    assert [a["k"] for a in r["acceptance"]] == [1, 2, 3, 4]
    for a in r["acceptance"]:
        assert a["rounds"] > 0 and 1.0 <= a["mean_accepted_length"] <= 1 + a["k"]
    for a in r["acceptance_by_confidence"]:  # chains of 1..6 drafts; accepted never more than drafted
        assert a["k"] == 6 and 1.0 <= a["drafts_per_round"] <= 6
        assert 1.0 <= a["mean_accepted_length"] <= 1 + a["drafts_per_round"]
    # tree drafting: width 1 is the chain of k=depth (a recompute here, the incremental propose there)
    chain, tree = r["tree_acceptance"]
    assert (chain["depth"], chain["width"], chain["budget"]) == (3, 1, 3) and chain["nodes_per_round"] == 3
    assert chain["mean_accepted_length"] == pytest.approx(r["acceptance"][2]["mean_accepted_length"], abs=0.03)
    assert tree["rounds"] > 0 and 1.0 <= tree["mean_accepted_length"] <= 4 and tree["nodes_per_round"] == 5
    # the teacher-forced features reproduce what the engine served: on every greedy sequence the
    # target's argmax at position t is the token the engine generated at t+1
    greedy = [s for s in data["train"] + data["eval"] if s.greedy]
    assert greedy and all(s.feats.shape == (len(s.ids), 64) for s in greedy)
    agree = sum(int((s.ids[s.prompt_len :] == s.argmax[s.prompt_len - 1 : -1]).sum()) for s in greedy)
    assert agree >= 0.99 * sum(len(s.ids) - s.prompt_len for s in greedy)


def test_loaded_head_proposes_like_a_full_recompute(trained, tiny_llama_dir):
    head_dir, data = trained
    head = EagleHead.from_pretrained(head_dir, tiny_llama_dir)
    s = data["eval"][0]
    n = s.prompt_len + 5
    kv = DraftKV.for_head(head)
    got = propose(head, [kv], [0], [s.ids[1 : n + 1]], [s.feats[:n]], 3)[0]
    f, t, want = s.feats[:n], s.ids[1 : n + 1], []
    with torch.no_grad():
        for _ in range(3):
            y = head(f[None], t[None])[0, -1]
            d = head.d2t[head.draft_logits(y).argmax()]
            want.append(int(d))
            f, t = torch.cat((f, y[None])), torch.cat((t, d[None]))
        _, kf, vf = head(f[None, : kv.length], t[None, : kv.length], return_kv=True)
    assert got == want
    torch.testing.assert_close(kv.k[:, : kv.length], kf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.v[:, : kv.length], vf[0], atol=1e-5, rtol=1e-5)


def test_trained_head_beats_untrained_on_training_data(trained, tiny_llama_dir):
    head_dir, data = trained
    trained_head = EagleHead.from_pretrained(head_dir, tiny_llama_dir)
    torch.manual_seed(0)
    fresh = EagleHead.from_target(tiny_llama_dir, trained_head.d2t).eval()
    cfg = TrainConfig(ttt_steps=1)
    before, after = top1(fresh, data["train"], cfg)[0], top1(trained_head, data["train"], cfg)[0]
    assert after > before + 0.05, (before, after)


def test_resume_goes_on_from_the_saved_head(trained, tiny_llama_dir, tmp_path):
    """--resume starts from the saved weights and keeps its draft vocabulary: after a few small
    steps it still beats a fresh head on the training data by what the first run's training won."""
    head_dir, data = trained
    cache = os.path.join(os.path.dirname(head_dir), "data.pt")
    with pytest.raises(SystemExit) as e:
        main(
            [
                "train-eagle",
                tiny_llama_dir,
                "--out",
                str(tmp_path / "more"),
                "--resume",
                head_dir,
                "--data-cache",
                cache,
                "--max-steps",
                "3",
                "--time-budget",
                "30",
                "--batch-tokens",
                "256",
                "--lr",
                "1e-5",
                "--no-latency",
            ]
        )
    assert e.value.code == 0
    more = json.load(open(tmp_path / "more" / REPORT_NAME))
    assert more["init"] == f"resumed from {head_dir}" and more["train"]["steps"] == 3
    saved = EagleHead.from_pretrained(head_dir, tiny_llama_dir)
    resumed = EagleHead.from_pretrained(str(tmp_path / "more"), tiny_llama_dir)
    assert torch.equal(resumed.d2t, saved.d2t)
    torch.manual_seed(0)
    fresh = EagleHead.from_target(tiny_llama_dir, saved.d2t).eval()
    cfg = TrainConfig(ttt_steps=1)
    base, was, now = (top1(h, data["train"], cfg)[0] for h in (fresh, saved, resumed))
    assert now > base + 0.05 and now == pytest.approx(was, abs=0.02), (base, was, now)


def test_bad_tree_shape_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train-eagle", "m", "--out", str(tmp_path), "--tree-report", "4x4"])
    assert e.value.code == 2 and "DEPTHxWIDTHxBUDGET" in capsys.readouterr().err


def test_split_by_prompt_is_stable_as_data_grows():
    """A prompt's side never changes when more prompts arrive, and both answers to a prompt share it."""

    def seqs(prompts):
        return [Sequence(ids=torch.tensor(p + [9, t]), prompt_len=len(p)) for p in prompts for t in (1, 2)]

    few = [[i, i + 1, i + 2] for i in range(40)]
    many = few + [[1000 + i, i] for i in range(400)]
    val_few, train_few = split_by_prompt(seqs(few), 0.1, 0)
    val_many, _ = split_by_prompt(seqs(many), 0.1, 0)
    side = {tuple(s.ids[: s.prompt_len].tolist()) for s in val_many}
    assert {tuple(s.ids[: s.prompt_len].tolist()) for s in val_few} == side & {tuple(p) for p in few}
    assert len(val_few) % 2 == 0 and len(train_few) + len(val_few) == 80
    assert 20 < len(val_many) // 2 < 70  # about 10% of 440 prompts
    val_two, train_two = split_by_prompt(seqs(few[:2]), 0.0, 0)  # at least one prompt held out
    assert len(val_two) == 2 and len(train_two) == 2

"""Guided alignment (qkv.train.alignment): eflomal's symmetrized links, the head's targets and loss,
and a head that learns them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkv.model.config import ConfigError, ModelConfig
from qkv.model.transformer import Transformer
from qkv.train import alignment
from qkv.train.alignment import (
    Links, align_pieces, alignment_loss, check_alignment_head, check_alignment_settings, grow_diag_final_and, link_targets, load_links,
    pieces_digest, save_links, shards,
)
from qkv.train.recipes import DataConfig


def test_grow_diag_final_and_grows_from_the_intersection():
    forward = {(0, 0), (1, 1), (2, 1)}
    reverse = {(0, 0), (1, 1), (3, 3)}
    # intersection {(0,0), (1,1)}; (2,1) neighbours (1,1) and aligns source 2, not yet aligned: grown;
    # (3,3) is in the union only, not next to a link, and aligns two unaligned words: added by final-and
    assert grow_diag_final_and(forward, reverse) == {(0, 0), (1, 1), (2, 1), (3, 3)}
    # a union link between two words both aligned already is not added
    assert (1, 0) not in grow_diag_final_and({(0, 0), (1, 1), (1, 0)}, {(0, 0), (1, 1)})


def test_eflomal_aligns_a_consistent_mapping():
    rng = np.random.default_rng(0)
    src, tgt = [], []
    for _ in range(300):  # source word w translates to target word 100 + w, in a reversed order
        words = rng.integers(1, 30, size=int(rng.integers(2, 7))).tolist()
        src.append(words)
        tgt.append([100 + w for w in reversed(words)])
    src.append([])
    tgt.append([5])
    links = align_pieces(src, tgt)
    assert len(links) == len(src) and links[-1].shape == (0, 2)
    right = total = 0
    for s, t, pairs in zip(src, tgt, links[:-1]):
        for i, j in pairs:
            total += 1
            right += t[j] == 100 + s[i]
    assert total >= 0.9 * sum(map(len, src)) and right / total > 0.95


def test_a_corpus_aligned_in_shards_keeps_every_pairs_own_links_at_its_index(monkeypatch):
    """Shards (alignment.SHARD pairs at most; here 200): eflomal never holds more than a shard, every
    pair keeps its own links at its own index (word w and its translation 100 + w, in reversed order, so
    another pair's links would not fit), and about as many, mostly the same, as one pass finds."""
    rng = np.random.default_rng(3)
    src, tgt = [], []
    for _ in range(601):
        words = rng.integers(1, 30, size=int(rng.integers(2, 8))).tolist()
        src.append(words)
        tgt.append([100 + w for w in reversed(words)])
    assert [len(r) for r in shards(601, 200)] == [150, 150, 150, 151] and shards(200, 200) == [range(200)]
    assert shards(0) == [] and sum(map(len, shards(10**7))) == 10**7 and max(map(len, shards(10**7))) <= alignment.SHARD
    seen, one_shard = [], alignment._align_shard
    monkeypatch.setattr(alignment, "_align_shard", lambda s, t, *, seed: seen.append(len(s)) or one_shard(s, t, seed=seed))
    sharded = align_pieces(src, tgt, shard=200)
    assert seen == [150, 150, 150, 151]  # what eflomal held at once
    whole = align_pieces(src, tgt)
    assert seen[-1] == 601 and isinstance(sharded, Links) and len(sharded) == len(whole) == 601
    right = total = same = 0
    for s, t, pairs, once in zip(src, tgt, sharded, whole):
        for i, j in pairs:
            assert i < len(s) and j < len(t)
            total += 1
            right += t[j] == 100 + s[i]
        same += len({tuple(x) for x in pairs.tolist()} & {tuple(x) for x in once.tolist()})
    assert right / total > 0.95 and abs(total - len(whole.flat)) < 0.05 * total and same > 0.9 * total
    assert sharded[600].tolist() == sharded.flat[sharded.offsets[600]:].tolist() and sharded[-1].tolist() == sharded[600].tolist()
    with pytest.raises(IndexError):
        sharded[601]


def test_link_targets_are_distributions_over_linked_pieces():
    links = [np.array([[0, 0], [1, 0], [2, 1]], dtype=np.int32), np.zeros((0, 2), dtype=np.int32)]
    target = link_targets(links, T=3, S=4)  # (B, T, S)
    assert target.shape == (2, 3, 4)
    assert torch.equal(target[0, 0], torch.tensor([0.5, 0.5, 0.0, 0.0]))
    assert torch.equal(target[0, 1], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert target[0, 2].sum() == 0 and target[1].sum() == 0  # an unlinked piece, a pair without links


def test_saved_links_are_read_back_only_for_the_same_pieces(tmp_path):
    src, tgt = [[1, 2], [3]], [[4], [5, 6]]
    links = [np.array([[0, 0], [1, 0]], dtype=np.int32), np.array([[0, 1]], dtype=np.int32)]
    digest = pieces_digest(src, tgt)
    save_links(tmp_path / "links.npz", links, digest)
    back = load_links(tmp_path / "links.npz", digest)
    assert [x.tolist() for x in back] == [x.tolist() for x in links]
    assert load_links(tmp_path / "links.npz", pieces_digest(src, [[4], [5, 7]])) is None  # other pieces


def test_the_alignment_head_learns_its_links():
    """Only the alignment loss, on a random model: the supervised head's weights go to the links."""
    torch.manual_seed(0)
    config = ModelConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1,
                         n_decoder_layers=2, dropout=0.0, alignment_layer=1)
    model = Transformer(config)
    src = torch.randint(3, 40, (8, 6))
    tgt_in = torch.randint(3, 40, (8, 6))
    links = [np.array([[5 - j, j] for j in range(6)], dtype=np.int32)] * 8  # target j <-> source 5 - j
    target = link_targets(links, T=6, S=6)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        _, head = model(src, tgt_in, project=False, alignment=True)
        loss = alignment_loss(head, target) / 48
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    with torch.no_grad():
        _, head = model(src, tgt_in, project=False, alignment=True)
    assert (head.argmax(-1) == torch.arange(5, -1, -1)).float().mean() > 0.9


def test_the_aligned_pass_computes_what_the_plain_pass_does():
    torch.manual_seed(1)
    config = ModelConfig(src_vocab_size=30, tgt_vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                         n_decoder_layers=2, alignment_layer=0).replace(dropout=0.0)
    model = Transformer(config).eval()
    src, tgt_in = torch.randint(3, 30, (3, 5)), torch.randint(3, 30, (3, 4))
    logits, head = model(src, tgt_in, alignment=True)
    torch.testing.assert_close(logits, model(src, tgt_in))
    assert head.shape == (3, 4, 5)
    torch.testing.assert_close(head.sum(-1), torch.ones(3, 4))


def test_a_full_context_head_sees_the_whole_target_and_not_its_padding():
    """alignment_context "full": the head's pass has no causal mask (a later target token changes an
    earlier row), padding changes no row, and the logits are the plain causal pass's; "causal": the
    head is the plain pass's own weights."""
    torch.manual_seed(2)
    base = ModelConfig(src_vocab_size=30, tgt_vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                       n_decoder_layers=2, alignment_layer=1, dropout=0.0)
    src, tgt_in = torch.randint(3, 30, (2, 5)), torch.randint(3, 30, (2, 4))
    full = Transformer(base.replace(alignment_context="full")).eval()
    logits, head = full(src, tgt_in, alignment=True)
    torch.testing.assert_close(logits, full(src, tgt_in))
    later = tgt_in.clone()
    later[:, -1] = (later[:, -1] + 1 - 3) % 27 + 3  # another last token
    _, changed = full(src, later, alignment=True)
    assert not torch.allclose(changed[:, 0], head[:, 0])  # row 0 saw the last token
    padded = torch.cat([tgt_in, torch.zeros(2, 3, dtype=torch.long)], dim=1)  # pad_id 0 after the target
    _, with_pad = full(src, padded, alignment=True)
    torch.testing.assert_close(with_pad[:, :4], head)
    causal = Transformer(base.replace(alignment_context="causal")).eval()
    causal.load_state_dict(full.state_dict())
    memory, src_mask, _ = causal.encode(src)
    _, weights = causal.decode(tgt_in, memory, src_mask, need_weights=True)
    torch.testing.assert_close(causal.alignment_head(tgt_in, memory, src_mask), weights.cross[1][:, 0])
    _, causal_changed = causal(src, later, alignment=True)
    torch.testing.assert_close(causal_changed[:, 0], weights.cross[1][:, 0, 0])  # a causal row never sees later tokens


def test_settings_guided_alignment_cannot_follow_are_refused():
    with pytest.raises(ConfigError, match="case_augment"):
        check_alignment_settings(0.05, DataConfig(case_augment=0.1), 4)
    with pytest.raises(ConfigError, match="alignment_layer 4"):
        ModelConfig(n_decoder_layers=4, alignment_layer=4)
    check_alignment_settings(0.0, DataConfig(case_augment=0.1), 4)  # off: nothing to refuse


def test_align_method_eflomal_aligns_the_given_pairs(random_checkpoint, tmp_path, capsys):
    from qkv.cli.main import main

    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(20)]
    src, tgt = [], []
    for _ in range(200):  # word wK translates to vK, in the same order
        line = [words[k] for k in rng.integers(0, 20, size=int(rng.integers(2, 6)))]
        src.append(" ".join(line))
        tgt.append(" ".join(w.replace("w", "v") for w in line))
    (tmp_path / "s").write_text("\n".join(src) + "\n")
    (tmp_path / "t").write_text("\n".join(tgt) + "\n")
    assert main(["align", "--checkpoint", str(random_checkpoint), "-i", str(tmp_path / "s"), "-r", str(tmp_path / "t"),
                 "--method", "eflomal"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 200
    found = [tuple(map(int, link.split("-"))) for line in lines for link in line.split()]
    assert sum(s == t for s, t in found) / len(found) > 0.9  # the diagonal, where each word's translation stands
    assert main(["align", "--checkpoint", str(random_checkpoint), "-i", str(tmp_path / "s"), "-r", str(tmp_path / "t"),
                 "--method", "eflomal", "--pieces"]) == 2


def test_a_head_named_without_guided_alignment_is_refused():
    """Issue 84: --model alignment_layer=1 (or alignment_context=full) without --train alignment=W
    trained no head but recorded one, which qkv align then read as trained."""
    for given in ({"alignment_layer": 1}, {"alignment_context": "full"}):
        with pytest.raises(ConfigError, match=f"--model {next(iter(given))}=.*--train alignment=W"):
            check_alignment_head(given, 0.0)
        check_alignment_head(given, 0.5)  # the head guided alignment trains
    check_alignment_head({"alignment_layer": None, "d_model": 64}, 0.0)  # a dumped config of a run without a head


def test_qkv_train_refuses_a_head_without_guided_alignment_before_loading_anything(tmp_path, capsys):
    from qkv.cli.main import main

    missing = tmp_path / "no-such-corpus.tsv"  # never read: the refusal comes first
    for flag in ("alignment_layer=1", "alignment_context=full"):
        code = main(["train", "--preset", "tiny", "--train-src", str(missing), "--valid-src", str(missing),
                     "--out", str(tmp_path / "run"), "--model", flag])
        err = capsys.readouterr().err
        assert code != 0 and "--train alignment=W" in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "run").exists()

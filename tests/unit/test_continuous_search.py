"""The continuous beam search (qkv.infer.continuous): sentences that join and leave a running search get
what the batched beam search gives each of them alone."""

from __future__ import annotations

import random

import pytest
import torch

from qkv.infer.continuous import TRIM, ContinuousBeamSearch, supports
from qkv.infer.search import DecodeConfig, beam_search, max_output_length
from qkv.model.config import model_preset
from qkv.model.transformer import Transformer

BOS, EOS = 1, 2


def random_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(model_preset("tiny", src_vocab_size=50, tgt_vocab_size=50, max_len=96)).eval()
    with torch.no_grad():
        model.generator.weight[EOS] *= 3.0  # EOS likelier: outputs of many lengths, some at their limit
    return model


def sources(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 50) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def run(search: ContinuousBeamSearch, srcs: list[list[int]], seed: int) -> tuple[dict, int]:
    """Sentences join 0-3 at a time before each step, in order; their hypotheses by index, and the most
    cache positions the search held."""
    rng, got, i, longest = random.Random(seed), {}, 0, 0
    while i < len(srcs) or len(search):
        n = rng.randrange(0, 4)
        search.add(srcs[i : i + n], list(range(i, min(i + n, len(srcs)))))
        i += n
        got.update(search.step())
        longest = max(longest, search.length)
    return got, longest


@pytest.mark.parametrize("n_best", [1, 3])
def test_each_sentence_gets_what_beam_search_gives_it_alone(n_best):
    model = random_model()
    config = DecodeConfig(beam_size=4, n_best=n_best, length_penalty=0.6, max_len_a=1.2, max_len_b=4)
    srcs = sources(60, seed=1)
    alone = [beam_search(model, torch.tensor([s + [EOS]]), bos_id=BOS, eos_id=EOS, config=config)[0] for s in srcs]
    got, longest = run(ContinuousBeamSearch(model, bos_id=BOS, eos_id=EOS, config=config), srcs, seed=2)
    assert sorted(got) == list(range(len(srcs)))
    assert len({len(h[0].tokens) for h in alone}) > 8  # outputs of many lengths: sentences leave at many steps
    for i, hyps in enumerate(alone):
        assert [h.tokens for h in got[i]] == [h.tokens for h in hyps], i
        assert [h.score for h in got[i]] == pytest.approx([h.score for h in hyps], abs=1e-5)
    # the search ran far longer than any output may, so positions were dropped from the caches' front
    limit = max(max_output_length(model, len(s) + 1, config) for s in srcs)
    assert longest <= limit + TRIM + 1 < sum(len(h[0].tokens) for h in alone) // 4


def test_a_suppressed_token_is_never_written_and_a_removed_sentence_leaves_the_rest_as_they_were():
    model = random_model(seed=3)
    config = DecodeConfig(beam_size=3, max_len_a=1.0, max_len_b=3)
    srcs = sources(30, seed=4)
    suppress = (7, 11)
    alone = [beam_search(model, torch.tensor([s + [EOS]]), bos_id=BOS, eos_id=EOS, config=config, suppress=suppress)[0][0]
             for s in srcs]
    search = ContinuousBeamSearch(model, bos_id=BOS, eos_id=EOS, config=config, suppress=suppress)
    search.add(srcs, list(range(len(srcs))))
    got = dict(search.step())
    search.remove({0, 5})  # nobody waits for these any more
    while len(search):
        got.update(search.step())
    assert 0 not in got and 5 not in got
    assert all(got[i][0].tokens == alone[i].tokens for i in got) and len(got) == len(srcs) - 2
    assert not any(t in suppress for i in got for t in got[i][0].tokens)


def test_what_it_does_not_search_it_refuses():
    model = random_model()
    assert supports(model, DecodeConfig(beam_size=2))
    for config in (DecodeConfig(beam_size=1), DecodeConfig(beam_size=2, no_repeat_ngram_size=3),
                   DecodeConfig(beam_size=1, sampling=True)):
        assert not supports(model, config)
        with pytest.raises(ValueError):
            ContinuousBeamSearch(model, bos_id=BOS, eos_id=EOS, config=config)
    search = ContinuousBeamSearch(model, bos_id=BOS, eos_id=EOS, config=DecodeConfig(beam_size=2))
    with pytest.raises(ValueError, match="empty"):
        search.add([[5, 6], []], ["a", "b"])

"""Search: the beam's step logic on hand-made numbers, greedy == beam of one, length limits and
penalties, n-best lists, and batch invariance (a sentence translates the same alone or in a batch)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from collections import Counter

import pytest
import torch

from qkv.io import checkpoint
from qkv.model.config import model_preset
from qkv.infer.search import (
    DecodeConfig,
    beam_candidates,
    beam_search,
    greedy_search,
    length_penalty,
    loops,
    max_output_length,
    repeated_ngram_ban,
    search,
    split_candidates,
)
from qkv.model.transformer import Transformer
from qkv.infer.translator import Translator, collate_sources, length_batches, suppressed_tokens
from qkv.infer.workers import DecodingWorkers

V, PAD, BOS, EOS = 23, 0, 2, 3
NEG_INF = float("-inf")


def make_model(seed: int = 0, *, never_eos: bool = False, **overrides) -> Transformer:
    """A random tiny model; ``never_eos`` gives EOS a huge negative output bias, so every output
    runs to its length limit."""
    torch.manual_seed(seed)
    config = model_preset("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=PAD, output_bias=never_eos, **overrides)
    model = Transformer(config).eval()
    if never_eos:
        with torch.no_grad():
            model.generator.bias[EOS] = -1e9
    return model


def sources(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, V, (n,), generator=generator).tolist() for n in lengths]


def batch(src_ids: list[list[int]]) -> torch.Tensor:
    return collate_sources(src_ids, pad_id=PAD, eos_id=EOS)


# ---- the beam's step, on hand-made log-probabilities ------------------------------------------


def test_beam_candidates_on_hand_made_numbers():
    scores = torch.tensor([[-1.0, -0.2], [0.0, NEG_INF]])  # sentence 2 has one live beam and an unused slot
    log_probs = torch.tensor(
        [
            [[-3.0, -0.5, -2.0, -1.2], [-0.1, -4.0, -1.6, -3.0]],
            [[-2.0, -0.3, -0.2, -5.0], [-0.01, -0.01, -0.01, -0.01]],
        ]
    )
    top, beam, token = beam_candidates(scores, log_probs, 4)
    # sentence 1, all eight totals: beam 0 -> -4.0 -1.5 -3.0 -2.2, beam 1 -> -0.3 -4.2 -1.8 -3.2;
    # the best four alternate between the beams
    torch.testing.assert_close(top[0], torch.tensor([-0.3, -1.5, -1.8, -2.2]))
    assert beam[0].tolist() == [1, 0, 1, 0]
    assert token[0].tolist() == [0, 1, 2, 3]
    # sentence 2: the unused slot's tempting -0.01s never win, since its score is -inf
    torch.testing.assert_close(top[1], torch.tensor([-0.2, -0.3, -2.0, -5.0]))
    assert beam[1].tolist() == [0, 0, 0, 0]
    assert token[1].tolist() == [2, 1, 0, 3]


def test_a_beam_step_splits_candidates_into_finished_and_live_on_hand_made_numbers():
    E = EOS
    # scores and tokens, best first, as beam_candidates returns 2K of them; K = 2; three sentences
    top = torch.tensor([[-0.1, -0.3, -0.4, -0.5, -0.9, NEG_INF]] * 2 + [[NEG_INF] * 6])
    token = torch.tensor([[E, 7, 5, E, 6, 4]] * 2 + [[5, E, 5, 5, 5, 5]])
    last_step = torch.tensor([False, True, False])
    finishing, stays = split_candidates(top, token, k=2, eos_id=E, last_step=last_step)
    # sentence 1: EOS at rank 0 finishes; the EOS at rank 3 is beaten by two live ones; the best two
    # without EOS stay, in order, and -0.9 is not needed
    assert finishing[0].tolist() == [True, False, False, False, False, False]
    assert stays[0].tolist() == [False, True, True, False, False, False]
    # sentence 2, at its last step: everything in the first K finishes, EOS or not, and nothing stays
    assert finishing[1].tolist() == [True, True, False, False, False, False]
    assert not stays[1].any()
    # sentence 3: -inf candidates come from unused slots and are never taken, even with nothing else
    assert not finishing[2].any() and not stays[2].any()


def test_length_penalty_is_gnmt_formula():
    assert length_penalty(7, 0.6) == pytest.approx(((5 + 7) / 6) ** 0.6) == pytest.approx(2**0.6)
    assert length_penalty(1, 1.0) == pytest.approx(1.0)
    assert length_penalty(13, 1.0) == pytest.approx(3.0)
    assert all(length_penalty(n, 0.0) == 1.0 for n in (1, 5, 50))


def test_decode_config_validation():
    with pytest.raises(ValueError, match="n_best"):
        DecodeConfig(beam_size=2, n_best=3)
    with pytest.raises(ValueError, match="beam_size"):
        DecodeConfig(beam_size=0)


# ---- search on random models -----------------------------------------------------------------


def test_beam_of_one_equals_greedy_on_a_padded_batch():
    for seed in range(3):
        model = make_model(seed)
        src = batch(sources([2, 9, 5, 1, 7, 3], seed))
        config = DecodeConfig(beam_size=1, length_penalty=0.0)
        greedy = greedy_search(model, src, bos_id=BOS, eos_id=EOS, config=config)
        beam = beam_search(model, src, bos_id=BOS, eos_id=EOS, config=config)
        assert [h[0].tokens for h in beam] == greedy
        assert [h[0].tokens for h in search(model, src, bos_id=BOS, eos_id=EOS, config=config)] == greedy


def teacher_forced_log_prob(model: Transformer, src_ids: list[int], tokens: list[int], with_eos: bool) -> float:
    target = tokens + [EOS] if with_eos else tokens
    logits = model(batch([src_ids]), torch.tensor([[BOS, *target[:-1]]]))  # (1, T, V)
    return logits.log_softmax(-1)[0].gather(-1, torch.tensor(target)[:, None]).sum().item()


def test_beam_scores_are_the_models_log_probabilities_and_n_best_is_sorted():
    model = make_model(1)
    src_ids = sources([3, 8, 1, 5], seed=1)
    config = DecodeConfig(beam_size=4, n_best=3, length_penalty=0.6, max_len_a=1.0, max_len_b=3)
    results = beam_search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config)
    assert [len(hyps) for hyps in results] == [3, 3, 3, 3]
    for ids, hyps in zip(src_ids, results):
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 3  # three different hypotheses
        limit = max_output_length(model, len(ids) + 1, config)
        for h in hyps:
            with_eos = len(h.tokens) < limit  # a hypothesis at the limit was cut, not ended by EOS
            assert h.log_prob == pytest.approx(teacher_forced_log_prob(model, ids, h.tokens, with_eos), abs=1e-4)
            length = len(h.tokens) + with_eos
            assert h.score == pytest.approx(h.log_prob / length_penalty(length, 0.6))


class ScriptedState:
    """Each beam's prefix (tokens after BOS), reordered as the search reorders its caches."""

    def __init__(self) -> None:
        self.prefixes: list[tuple[int, ...]] = []

    def reorder(self, index: torch.Tensor, kinds: tuple[str, ...] = ("self", "cross")) -> None:
        if "self" in kinds:
            self.prefixes = [self.prefixes[i] for i in index.tolist()]


class ScriptedModel:
    """A decoder whose next-token probabilities are a table over the prefix; the source is ignored.
    Tokens: 0 pad, 1 BOS, 2 EOS, 3 "a", 4 "b"; a prefix not in the table ends with probability 0.9."""

    config = model_preset("tiny", src_vocab_size=5, tgt_vocab_size=5, pad_id=0)

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]]) -> None:
        self.table = table

    def encode(self, src: torch.Tensor):
        return torch.zeros(src.size(0), src.size(1), 2), src != 0, []

    def new_state(self, capacity: int = 16) -> ScriptedState:
        return ScriptedState()

    def decode(self, tgt: torch.Tensor, memory, src_mask, *, state: ScriptedState, need_weights: bool = False):
        tokens = tgt[:, -1].tolist()
        state.prefixes = [() for _ in tokens] if not state.prefixes else [p + (t,) for p, t in zip(state.prefixes, tokens)]
        log_probs = torch.full((len(tokens), 1, 5), -1e9)
        for row, prefix in enumerate(state.prefixes):
            for token, p in self.table.get(prefix, {2: 0.9, 3: 0.05, 4: 0.05}).items():
                log_probs[row, 0, token] = math.log(p)
        return log_probs, None


def test_beam_search_returns_the_best_normalised_hypothesis_not_the_first_k_to_finish():
    # K = 2, alpha = 1. Step 0 finishes "" (log 0.30); step 1 finishes "a" (log 0.62 + log 0.4), the
    # second hypothesis: a search that stops at K finished hypotheses returns "a". But the live beam
    # "a a" ends next with probability 0.9, and its normalised score is provably better.
    a, b = 3, 4
    model = ScriptedModel({(): {2: 0.30, a: 0.62, b: 0.08}, (a,): {2: 0.4, a: 0.6}, (a, a): {2: 0.9, a: 0.1}})
    lp = lambda n: length_penalty(n, 1.0)  # noqa: E731
    first_k = (math.log(0.62) + math.log(0.4)) / lp(2)  # "a": -1.195
    longer = (math.log(0.62) + math.log(0.6) + math.log(0.9)) / lp(3)  # "a a": -0.821
    assert longer > first_k > math.log(0.30) / lp(1)
    config = DecodeConfig(beam_size=2, n_best=2, length_penalty=1.0, max_len_a=0.0, max_len_b=6)
    (hyps,) = beam_search(model, torch.tensor([[3, 2]]), bos_id=1, eos_id=2, config=config)
    assert [h.tokens for h in hyps] == [[a, a], [a]]
    assert hyps[0].score == pytest.approx(longer) and hyps[1].score == pytest.approx(first_k)


def test_beam_search_stops_when_no_live_beam_can_win():
    # Every prefix ends with probability 0.9 except the first step: the search must not run on to the
    # length limit (20 steps) once the live beams' bound falls below the best finished hypothesis.
    model = ScriptedModel({(): {2: 0.5, 3: 0.3, 4: 0.2}})
    calls = []
    decode = model.decode
    model.decode = lambda *args, **kwargs: calls.append(1) or decode(*args, **kwargs)
    config = DecodeConfig(beam_size=2, length_penalty=1.0, max_len_a=0.0, max_len_b=20)
    (hyps,) = beam_search(model, torch.tensor([[3, 2]]), bos_id=1, eos_id=2, config=config)
    assert hyps[0].tokens == [] and hyps[0].score == pytest.approx(math.log(0.5))
    assert len(calls) < 20


def test_every_sentence_stops_at_its_own_length_limit():
    # max_len_a * (source tokens + EOS) + max_len_b, per sentence, even in a batch with longer ones
    model = make_model(2, never_eos=True)
    src_ids = sources([1, 4, 9])
    config = DecodeConfig(beam_size=3, max_len_a=0.5, max_len_b=2)
    expected = [int(0.5 * 2 + 2), int(0.5 * 5 + 2), int(0.5 * 10 + 2)]  # 3, 4, 7
    greedy = greedy_search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config)
    assert [len(tokens) for tokens in greedy] == expected
    beam = beam_search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config)
    assert [len(hyps[0].tokens) for hyps in beam] == expected


def test_output_length_is_capped_by_the_models_positions():
    model = make_model(3, never_eos=True, max_len=12)
    config = DecodeConfig(beam_size=2, max_len_a=2.0, max_len_b=50)
    src = batch(sources([4]))
    assert len(greedy_search(model, src, bos_id=BOS, eos_id=EOS, config=config)[0]) == 11
    assert len(beam_search(model, src, bos_id=BOS, eos_id=EOS, config=config)[0][0].tokens) == 11


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_sentence_decodes_the_same_alone_or_in_a_padded_batch(beam_size):
    model = make_model(4)
    src_ids = sources([6, 1, 11, 3, 8], seed=4)
    config = DecodeConfig(beam_size=beam_size)
    together = search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config)
    alone = [search(model, batch([ids]), bos_id=BOS, eos_id=EOS, config=config)[0] for ids in src_ids]
    assert [h[0].tokens for h in together] == [h[0].tokens for h in alone]
    if beam_size > 1:
        for a, b in zip(together, alone):
            assert a[0].score == pytest.approx(b[0].score, abs=1e-5)


# ---- batching helpers ------------------------------------------------------------------------


def test_collate_sources_appends_eos_and_pads_right():
    assert collate_sources([[5, 6], [7], [8, 9, 10]], pad_id=PAD, eos_id=EOS).tolist() == [
        [5, 6, EOS, PAD],
        [7, EOS, PAD, PAD],
        [8, 9, 10, EOS],
    ]


def test_length_batches_respect_both_budgets_and_cover_every_sentence():
    lengths = [5, 1, 3, 8, 2, 2, 7, 1]
    batches = length_batches(lengths, max_tokens=12, max_sentences=2)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 2
        assert len(b) == 1 or (max(lengths[i] for i in b) + 1) * len(b) <= 12
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)  # grouped by length, shortest first


# ---- through the Translator, with a trained tiny model -----------------------------------------


@pytest.fixture(scope="module")
def trained(tiny_run) -> checkpoint.Checkpoint:
    return checkpoint.load(tiny_run)


SENTENCES = [
    "A man in a blue shirt is standing on a ladder cleaning windows.",
    "",
    "A dog.",
    "Two young girls are playing in the sand near the water at the beach while their mother watches.",
    "   ",
    "Men are talking.",
    "A woman with a large purse is walking by a gate.",
]


@pytest.mark.parametrize("beam_size", [1, 3])
def test_translator_keeps_input_order_and_is_batch_invariant(trained, beam_size):
    config = DecodeConfig(beam_size=beam_size)
    # a small token budget splits the batch, so length sorting has to be undone
    translator = Translator(trained.model, trained.tokenizer, config, max_tokens=40)
    together = translator.translate(SENTENCES)
    alone = [translator.translate([s])[0] for s in SENTENCES]
    assert together == alone
    assert len(together) == len(SENTENCES)
    assert together[1] == "" and together[4] == ""  # empty and blank inputs give empty outputs
    assert all(together[i] for i in (0, 2, 3, 5, 6))


@pytest.mark.parametrize("beam_size", [1, 5])
def test_translator_batches_hold_max_tokens_source_tokens_whatever_the_beam(trained, monkeypatch, beam_size):
    import qkv.infer.translator

    shapes = []
    real_search = qkv.infer.translator.search
    monkeypatch.setattr(qkv.infer.translator, "search", lambda model, src, **kw: shapes.append(tuple(src.shape)) or real_search(model, src, **kw))
    Translator(trained.model, trained.tokenizer, DecodeConfig(beam_size=beam_size), max_tokens=60).translate(SENTENCES * 3)
    assert all(b * s <= 60 for b, s in shapes) and sum(b for b, _ in shapes) == 15  # the 15 non-empty sentences
    assert max(b * s for b, s in shapes) > 60 // 2  # the budget is used, not divided by the beam


@pytest.mark.parametrize("beam_size", [1, 4])
def test_decoding_workers_give_the_translations_of_one_process(trained, beam_size):
    """Two forked workers of one thread each search the batches side by side: the translations and
    scores of one process with one thread, in the input order, whichever worker finished first;
    they end with the Translator."""
    config = DecodeConfig(beam_size=beam_size, n_best=2 if beam_size > 1 else 1)
    texts = SENTENCES * 3

    def plain(nbest):  # greedy search gives no scores (NaN, which equals nothing)
        return [[(t.text, t.tokens, repr(t.score)) for t in n] for n in nbest]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker's thread count: the sums then round alike, bit for bit
    try:
        one = plain(Translator(trained.model, trained.tokenizer, config, max_tokens=40).translate_nbest(texts))
    finally:
        torch.set_num_threads(threads)
    with Translator(trained.model, trained.tokenizer, config, max_tokens=40, workers=2) as translator:
        two = plain(translator.translate_nbest(texts))
        assert translator._pool is not None
        processes = list(translator._pool._pool._processes.values())
        assert len(processes) == 2 and all(p.is_alive() for p in processes)
        assert plain(translator.translate_nbest(texts)) == two  # the same workers serve every later call
    assert translator._pool is None and not any(p.is_alive() for p in processes)
    assert two == one


def test_an_input_of_one_batch_is_searched_without_starting_workers(trained):
    """What `--workers auto` relies on for a line typed at a terminal: one batch stays in the process."""
    with Translator(trained.model, trained.tokenizer, DecodeConfig(beam_size=2), workers=2) as translator:
        translator.translate(SENTENCES[:1])
        assert translator._pool is None
        translator.translate(SENTENCES * 40)  # more than one batch of 2,048 tokens
        assert translator._pool is not None


def test_decoding_workers_run_one_thread_each_whatever_the_parent_runs():
    """However many threads the command runs (here 4), a worker runs one: the layout that makes its
    sums round as one process with one thread does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        workers = DecodingWorkers(lambda item: (item, torch.get_num_threads()), 2)
        try:
            assert list(workers.map(range(6))) == [(i, 1) for i in range(6)]
        finally:
            workers.close()
    finally:
        torch.set_num_threads(threads)


def test_workers_through_the_command_line(tiny_run, tmp_path):
    """``qkv translate --workers 2`` writes what one process with one thread writes, line for line,
    and ``qkv evaluate --workers 2`` scores the same; without --workers (auto) the commands run one
    worker per usable CPU, with the same output; a bad count is a one-line error."""
    src = tmp_path / "in.en"
    src.write_text("\n".join(SENTENCES * 4) + "\n")
    qkv = [sys.executable, "-m", "qkv"]
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --device cpu: worker processes are a CPU mode, and auto would take a GPU where there is one.
    common = ["--checkpoint", str(tiny_run), "--device", "cpu", "--beam", "3", "--batch-tokens", "40"]
    one = subprocess.run([*qkv, "translate", *common, "-i", str(src), "--workers", "1"], capture_output=True, text=True, env=one_thread)
    two = subprocess.run([*qkv, "translate", *common, "-i", str(src), "--workers", "2"], capture_output=True, text=True)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert len(two.stdout.splitlines()) == len(SENTENCES) * 4 and two.stdout == one.stdout
    ref = tmp_path / "ref.de"  # the sources as references, named for the model's target language (evaluate checks)
    ref.write_text(src.read_text())
    scored = [subprocess.run([*qkv, "evaluate", *common, "--src-file", str(src), "--ref-file", str(ref), *extra],
                             capture_output=True, text=True, env=env)
              for extra, env in ((["--workers", "1"], one_thread), (["--workers", "2"], None), ([], None))]
    assert all(r.returncode == 0 for r in scored), scored[1].stderr
    assert "2 workers" in scored[1].stdout and "workers" not in scored[0].stdout.splitlines()[0]
    assert scored[0].stdout.splitlines()[1] == scored[1].stdout.splitlines()[1] == scored[2].stdout.splitlines()[1]
    cpus = len(os.sched_getaffinity(0))
    assert (f", {cpus} workers" in scored[2].stdout.splitlines()[0]) == (cpus > 1)  # auto: one per usable CPU
    auto = subprocess.run([*qkv, "translate", *common, "-i", str(src)], capture_output=True, text=True)
    assert auto.returncode == 0 and auto.stdout == one.stdout
    bad = subprocess.run([*qkv, "translate", *common, "-i", str(src), "--workers", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "workers must be >= 1" in bad.stderr and bad.stdout == ""


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_decoding_workers_end_when_the_command_is_killed(tiny_run, tmp_path):
    """A killed ``qkv translate --workers 2`` leaves no process behind, and no output file."""
    src = tmp_path / "in.en"
    src.write_text("\n".join(SENTENCES * 400) + "\n")
    command = [sys.executable, "-m", "qkv", "translate", "--checkpoint", str(tiny_run), "--device", "cpu", "--beam", "3",
               "--batch-tokens", "40", "--workers", "2", "-i", str(src), "-o", str(tmp_path / "out.de")]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    deadline = time.monotonic() + 120
    while len(workers) < 2 and process.poll() is None and time.monotonic() < deadline:
        workers = _children(process.pid)
        time.sleep(0.05)
    assert len(workers) == 2 and process.poll() is None
    process.kill()
    process.wait()
    deadline = time.monotonic() + 10
    while any(map(_running, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_running, workers))
    assert not (tmp_path / "out.de").exists()


def test_decoding_workers_are_for_the_cpu_and_at_least_one(trained):
    with pytest.raises(ValueError, match="workers must be >= 1"):
        Translator(trained.model, trained.tokenizer, workers=0)
    elsewhere = Transformer(trained.model.config).to("meta")  # a model not on the CPU (a GPU's case, here without one)
    with pytest.raises(ValueError, match="decoding workers are for the CPU; the model is on meta"):
        Translator(elsewhere, trained.tokenizer, workers=2)
    assert Translator(elsewhere, trained.tokenizer).workers == 1  # one process is fine anywhere


def test_translator_n_best_lists(trained):
    translator = Translator(trained.model, trained.tokenizer, DecodeConfig(beam_size=4, n_best=2))
    nbest = translator.translate_nbest(["A dog runs.", "", "Two men are talking on a bench."])
    assert [len(n) for n in nbest] == [2, 1, 2]
    for n in (nbest[0], nbest[2]):
        assert n[0].score >= n[1].score and n[0].tokens != n[1].tokens
        assert n[0].text == trained.tokenizer.decode(n[0].tokens)
    assert nbest[1][0].text == ""
    assert math.isfinite(nbest[0][0].score)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_suppressed_tokens_are_never_output(beam_size):
    model, src = make_model(0), batch(sources([6, 9, 4, 7], seed=2))
    config = DecodeConfig(beam_size=beam_size, n_best=beam_size, max_len_b=8)
    free = search(model, src, bos_id=BOS, eos_id=EOS, config=config)
    common = Counter(t for hyps in free for h in hyps for t in h.tokens).most_common(1)[0][0]  # a token it does use
    held = search(model, src, bos_id=BOS, eos_id=EOS, config=config, suppress=(common,))
    assert all(common not in h.tokens for hyps in held for h in hyps) and held != free


def test_a_decoder_that_starts_from_pad_never_outputs_pad():
    from types import SimpleNamespace

    assert suppressed_tokens(SimpleNamespace(bos_id=0, pad_id=0)) == (0,)  # Marian: <pad> starts the decoder
    assert suppressed_tokens(SimpleNamespace(bos_id=2, pad_id=0)) == ()  # qkv's own tokenizer


@pytest.mark.parametrize("V", [1000, 1024, 8000, 130])
def test_beam_candidates_by_blocks_equal_one_topk_over_every_candidate(V):
    """The blockwise search (a vocabulary of many blocks, the last one short or not) finds the same
    candidates as one topk over all K * V sums, including beams whose slot is unused (-inf)."""
    generator = torch.Generator().manual_seed(V)
    B, K, k = 6, 5, 10
    log_probs = torch.randn(B, K, V, generator=generator).log_softmax(dim=-1)
    scores = -torch.rand(B, K, generator=generator) * 5
    scores[1, 3:] = NEG_INF
    scores[2, 1:] = NEG_INF
    log_probs[3, :, -1] = 0.0  # the best token is the last one, in the short block
    top, beam, token = beam_candidates(scores, log_probs, k, block=128)
    expected, flat = (scores[:, :, None] + log_probs).view(B, K * V).topk(k, dim=-1)
    torch.testing.assert_close(top, expected, rtol=0, atol=0)
    assert beam.tolist() == (flat // V).tolist()
    assert token.tolist() == (flat % V).tolist()
    assert token[3, 0] == V - 1  # found in the last block (short unless V is a multiple of 128)


@pytest.mark.parametrize("V", [1000, 1024, 700, 130])
def test_block_argmax_is_argmax_with_its_ties_nans_and_infinities(V):
    from qkv.infer.search import block_argmax

    generator = torch.Generator().manual_seed(V)
    x = torch.randint(-50, 4, (64, V), generator=generator).float()  # many ties at the maximum
    x[1] = float("-inf")  # no finite score: index 0, like argmax
    x[2, 7], x[2, V - 3] = float("nan"), float("nan")  # NaN wins, the first one
    x[3, V - 1] = 100.0  # the maximum in the last (short unless V % 128 == 0) block
    x[4] = 3.0  # every element a maximum
    x[5, :] = -1.0
    x[5, 200 % V], x[5, 129 % V] = 2.0, 2.0  # the same maximum in two blocks: the first counts
    torch.testing.assert_close(block_argmax(x), x.argmax(dim=-1), rtol=0, atol=0)
    assert block_argmax(x)[2] == 7 and block_argmax(x)[3] == V - 1


# ---- the incremental step (qkv.model.incremental) ----------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"norm_first": False}, {"d_k": 6, "d_v": 10}, {"norm_first": True, "activation": "gelu"}])
@torch.inference_mode()
def test_the_incremental_step_gives_the_general_paths_logits_step_by_step(overrides, monkeypatch):
    from qkv.model import incremental

    model = make_model(7, **overrides)
    src_ids = sources([6, 1, 11, 3], seed=7)
    src = batch(src_ids)
    memory, src_mask, _ = model.encode(src)
    G = 3  # beams of a sentence side by side: cross-attention folds them
    memory_rows, mask_rows = memory, src_mask
    fast, slow = model.new_state(4), model.new_state(4)
    last = torch.full((len(src_ids) * G, 1), BOS)
    calls = []
    step = incremental.decode_step
    for t in range(6):
        monkeypatch.setattr(incremental, "decode_step", lambda *a: calls.append(1) or step(*a))
        a, _ = model.decode(last, memory_rows, mask_rows, state=fast)
        monkeypatch.setattr(incremental, "applies", lambda *a, **k: False)
        b, _ = model.decode(last, memory_rows, mask_rows, state=slow)
        monkeypatch.undo()
        assert a.shape == b.shape == (len(last), 1, V)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        last = a[:, -1].argmax(-1, keepdim=True)
        if t == 3:  # beam search drops a finished sentence: every cache keeps the other rows
            keep = torch.tensor([0, 2, 3])
            rows = (keep[:, None] * G + torch.arange(G)).view(-1)
            memory_rows, mask_rows, last = memory_rows[keep], mask_rows[keep], last[rows]
            for state in (fast, slow):
                state.reorder(keep, kinds=("cross",))
                state.reorder(rows, kinds=("self",))
    assert len(calls) == 6  # the fast path did run


@pytest.mark.parametrize("beam_size", [1, 4])
def test_searches_translate_the_same_through_the_incremental_step(beam_size, monkeypatch):
    from qkv.model import incremental

    model = make_model(8)
    src = batch(sources([6, 1, 11, 3, 8], seed=8))
    config = DecodeConfig(beam_size=beam_size, n_best=min(2, beam_size))
    fast = search(model, src, bos_id=BOS, eos_id=EOS, config=config)
    monkeypatch.setattr(incremental, "applies", lambda *a, **k: False)
    slow = search(model, src, bos_id=BOS, eos_id=EOS, config=config)
    assert [[h.tokens for h in hs] for hs in fast] == [[h.tokens for h in hs] for hs in slow]
    if beam_size > 1:
        for a, b in zip(fast, slow):
            assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


@torch.inference_mode()
def test_an_all_padding_source_row_takes_the_general_path():
    from qkv.model import incremental

    model = make_model(9)
    src = batch(sources([4, 5], seed=9))
    src[1] = PAD  # no real token: the general path's guard against a softmax over nothing applies
    memory, src_mask, _ = model.encode(src)
    state = model.new_state(4)
    assert not incremental.applies(model, torch.full((2, 1), BOS), src_mask, state, False)
    logits, _ = model.decode(torch.full((2, 1), BOS), memory, src_mask, state=state)
    assert torch.isfinite(logits).all()


# ---- the loop guard and the repeated-n-gram ban (issue 66) --------------------------------------


def test_the_repeated_ngram_ban_on_hand_made_histories():
    history = torch.tensor([[5, 6, 5], [5, 6, 7], [4, 4, 4]])
    ban = repeated_ngram_ban(history, 2, 9)
    assert ban[0].tolist() == [0] * 6 + [NEG_INF] + [0] * 2  # "5 6" was seen: after "5", 6 would repeat it
    assert (ban[1] == 0).all()  # "7" never started a bigram
    assert ban[2, 4] == NEG_INF and (ban[2, :4] == 0).all()
    assert repeated_ngram_ban(history, 1, 9)[1, [5, 6, 7]].tolist() == [NEG_INF] * 3
    assert (repeated_ngram_ban(history, 4, 9) == 0).all()  # shorter than n: nothing to repeat


def _repeats_an_ngram(tokens: list[int], n: int) -> bool:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


@pytest.mark.parametrize("beam_size", [1, 3])
def test_no_repeat_ngram_size_leaves_no_ngram_twice(beam_size):
    model = make_model(2, never_eos=True)  # runs to its limit: 2 * 9 + 4 tokens from 19 - 4 ids
    src_ids = sources([4, 8], seed=2)
    plain = search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=DecodeConfig(beam_size=beam_size, max_len_a=2.0, max_len_b=4))
    assert any(_repeats_an_ngram(h[0].tokens, 2) for h in plain)  # what the ban is for
    config = DecodeConfig(beam_size=beam_size, max_len_a=2.0, max_len_b=4, no_repeat_ngram_size=2)
    for hyps in search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config):
        assert not _repeats_an_ngram(hyps[0].tokens, 2)
    # over a shortlist's ids too (each sentence's own subset of the vocabulary)
    vocab = [torch.arange(4, 16), torch.arange(8, V)]
    for hyps in search(model, batch(src_ids), bos_id=BOS, eos_id=EOS, config=config, vocab=vocab):
        assert not _repeats_an_ngram(hyps[0].tokens, 2)


def test_what_counts_as_a_loop():
    assert loops([7, 7, 7], limit=20) and loops([4, 5, 6, 4, 5, 6, 4, 5, 6, 9], limit=20)
    assert not loops([7, 7, 8, 7], limit=20) and not loops([4, 5, 4, 5, 6], limit=20)
    assert loops([4, 5, 6, 7], limit=4)  # no EOS before the length limit
    assert not loops([], limit=4)


def test_the_loop_guard_searches_again_only_the_sentences_that_loop():
    # "a" loops ("a a a ...") where the prefix is not in the table; after "b" the model ends at once
    a, b = 3, 4
    looping = ScriptedModel({(): {a: 0.6, b: 0.4}, (b,): {2: 0.9, a: 0.1}, **{(a,) * n: {a: 0.9, 2: 0.1} for n in range(1, 12)}})
    config = DecodeConfig(beam_size=2, length_penalty=1.0, max_len_a=0.0, max_len_b=10)
    (plain,) = beam_search(looping, torch.tensor([[3, 2]]), bos_id=1, eos_id=2, config=config)
    assert loops(plain[0].tokens, 10)
    guarded = search(looping, torch.tensor([[3, 2]]), bos_id=1, eos_id=2, config=replace(config, loop_guard=1))
    assert not loops(guarded[0][0].tokens, 10)
    # a sentence that does not loop keeps the first search's result, hypothesis for hypothesis
    model, src = make_model(4), batch(sources([6, 3, 9], seed=4))
    for beam_size in (1, 3):
        config = DecodeConfig(beam_size=beam_size, n_best=1)
        off = search(model, src, bos_id=BOS, eos_id=EOS, config=config)
        on = search(model, src, bos_id=BOS, eos_id=EOS, config=replace(config, loop_guard=2))
        limits = [max_output_length(model, n + 1, config) for n in (6, 3, 9)]
        for first, guarded, limit in zip(off, on, limits):
            if not loops(first[0].tokens, limit):
                assert guarded[0].tokens == first[0].tokens
                assert guarded[0].score == first[0].score or math.isnan(first[0].score)
            else:
                assert not _repeats_an_ngram(guarded[0].tokens, 2)


def test_a_tab_between_a_lines_sentences_makes_no_column_of_its_own(random_checkpoint, tmp_path, capsys):
    # the line's sentences joined back with the tab between them broke the n-best and --confidence columns
    from qkv.cli import main as cli

    source = tmp_path / "src"
    source.write_text("A dog runs.\tA cat sleeps.\nTwo children play.\n", encoding="utf-8")
    for flags, columns in ((["--n-best", "2"], 4), (["--confidence"], 3)):
        assert cli.main(["translate", "--checkpoint", str(random_checkpoint), "-i", str(source), "--beam", "2", *flags]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 2 and [len(line.split("\t")) for line in lines] == [columns, columns]

"""`qkv serve` beyond beam search: n-best lists with scores, sampling under a seed, the work these ask
for, and requests with different settings batched together.

The app runs in this process (httpx's ASGI transport, the batcher's real worker thread) on the
session's random checkpoint (tests/conftest.py), which translates in milliseconds. The checks that an
invalid option answers 422 are with the others in tests/e2e/test_server.py (BAD_REQUESTS).
"""

import asyncio
import math
import re

import httpx
import pytest
import torch

from qkv.io import checkpoint
from qkv.infer.search import DecodeConfig, beam_search
from qkv.serve.app import create_app
from qkv.infer.translator import Translator, collate_sources

TEXTS = ["A dog runs.", "Two children play with a red ball.", "Ein Hund rennt über die grüne Wiese.", ""]


@pytest.fixture(scope="module")
def loaded(random_checkpoint):
    return checkpoint.load(random_checkpoint)


def exchange(checkpoint_dir, bodies: list[dict], *, together: bool = False, **limits) -> tuple[list[httpx.Response], dict]:
    """POST each body to a fresh app, one after the other or all at once; also the app's /v1/stats after."""
    app = create_app(checkpoint_dir, **limits)

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=60) as client:
                if together:
                    responses = await asyncio.gather(*[client.post("/v1/translate", json=b) for b in bodies])
                else:
                    responses = [await client.post("/v1/translate", json=b) for b in bodies]
                return list(responses), (await client.get("/v1/stats")).json()

    return asyncio.run(scenario())


def answers(checkpoint_dir, bodies: list[dict], **kwargs) -> list[dict]:
    responses, _ = exchange(checkpoint_dir, bodies, **kwargs)
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
    return [r.json() for r in responses]


def test_n_best_lists_come_best_first_with_the_scores_qkv_translate_prints(random_checkpoint, loaded):
    plain, nbest = answers(random_checkpoint, [{"texts": TEXTS, "beam_size": 4}, {"texts": TEXTS, "beam_size": 4, "n_best": 3}])
    assert set(plain) == {"translations"}  # without n_best, the answer is as before
    assert nbest["translations"] == plain["translations"]
    # qkv translate --n-best 3 --beam 4 (the server's batch limits, so the batches are the same)
    config = DecodeConfig(beam_size=4, n_best=3)
    expected = Translator(loaded.model, loaded.tokenizer, config, max_tokens=4096, max_sentences=32).translate_nbest(TEXTS)
    assert len(nbest["n_best"]) == len(TEXTS)
    for text, translation, candidates, reference in zip(TEXTS, nbest["translations"], nbest["n_best"], expected):
        assert len(candidates) == (3 if text else 1)  # an empty text has one empty translation
        assert candidates[0]["translation"] == translation
        scores = [c["score"] for c in candidates]
        assert scores == sorted(scores, reverse=True)
        assert all(math.isfinite(s) for s in scores)
        assert [(c["translation"], c["score"]) for c in candidates] == [(t.text, round(t.score, 4)) for t in reference]
    assert len({c["translation"] for c in nbest["n_best"][0]}) == 3, "the test needs three different translations"


def test_greedy_and_sampled_outputs_are_scored_as_a_beam_of_one_scores_them(random_checkpoint, loaded):
    # Greedy search and sampling give no scores of their own: the server scores their outputs.
    texts = TEXTS[:3]
    greedy, sampled = answers(random_checkpoint, [
        {"texts": texts, "beam_size": 1, "n_best": 1},
        {"texts": texts, "sampling": True, "seed": 3, "n_best": 1},
    ])
    tok = loaded.tokenizer
    for text, (candidate,) in zip(texts, greedy["n_best"]):
        src = collate_sources([tok.encode(text)], pad_id=tok.pad_id, eos_id=tok.eos_id)
        (best,) = beam_search(loaded.model, src, bos_id=tok.bos_id, eos_id=tok.eos_id, config=DecodeConfig(beam_size=1))[0]
        assert candidate["translation"] == tok.decode(best.tokens)
        assert candidate["score"] == pytest.approx(best.score, abs=2e-4)
    # Among them outputs that end with EOS and outputs cut at the maximum length (the random model
    # rarely says EOS), so both ways of counting the length are checked.
    assert len({len(c["translation"]) for (c,) in greedy["n_best"]}) > 1
    assert [c["translation"] for (c,) in sampled["n_best"]] == sampled["translations"]
    assert all(math.isfinite(c["score"]) for (c,) in sampled["n_best"])


def test_a_seed_repeats_a_sample_and_another_seed_changes_it(random_checkpoint, loaded):
    body = {"texts": ["A dog runs."], "sampling": True, "seed": 1}
    first, again, other = answers(random_checkpoint, [body, body, {**body, "seed": 2}])
    assert again == first
    assert other["translations"] != first["translations"]  # checked once by hand: they differ on this model
    # The sample `qkv translate --sampling --seed 1` writes for the same sentence.
    config = DecodeConfig(beam_size=1, sampling=True, seed=1)
    assert first["translations"] == Translator(loaded.model, loaded.tokenizer, config).translate(body["texts"])
    # The other options change the sample too, and repeat as well.
    tuned = {**body, "temperature": 0.7, "top_k": 5, "top_p": 0.9}
    tuned_first, tuned_again = answers(random_checkpoint, [tuned, tuned])
    assert tuned_first == tuned_again and tuned_first != first


def test_a_sample_does_not_depend_on_its_batch(random_checkpoint):
    alone = {"texts": ["A dog runs."], "sampling": True, "seed": 5}
    crowd = {"texts": ["Two children play.", "A dog runs.", "", "Ein Hund rennt."], "sampling": True, "seed": 5}
    (expected,) = answers(random_checkpoint, [alone])
    in_a_request = answers(random_checkpoint, [crowd])[0]["translations"][1]
    # Sent at once, the requests below share one batch (equal settings) with other sentences.
    together = answers(random_checkpoint, [crowd, alone, crowd], together=True, max_wait_ms=300)
    assert in_a_request == expected["translations"][0]
    assert together[1] == expected and all(a["translations"][1] == in_a_request for a in (together[0], together[2]))


MIXED = [
    {"texts": TEXTS, "beam_size": 1},
    {"texts": TEXTS, "beam_size": 3},
    {"texts": TEXTS[:2], "beam_size": 3, "n_best": 2},  # the same search as the one above: one batch
    {"texts": TEXTS[1:], "beam_size": 3, "n_best": 3, "attention": True},  # and this one too
    {"texts": TEXTS, "beam_size": 3, "max_length": 4},
    {"texts": TEXTS, "sampling": True, "seed": 1},
    {"texts": TEXTS, "sampling": True, "seed": 2, "n_best": 1},
    {"texts": TEXTS, "sampling": True, "seed": 1, "temperature": 0.5},
    {"texts": TEXTS, "sampling": True, "seed": 1, "top_k": 3},
    {"texts": TEXTS, "sampling": True, "seed": 1, "top_p": 0.5, "attention": True},
]


@pytest.mark.parametrize("batching", ["batches", "continuous"])
def test_requests_with_different_settings_batched_together_get_what_they_get_alone(random_checkpoint, batching):
    alone = answers(random_checkpoint, MIXED, batching="batches")
    responses, stats = exchange(random_checkpoint, MIXED, together=True, max_wait_ms=500, batching=batching)
    assert [r.status_code for r in responses] == [200] * len(MIXED)
    assert [r.json() for r in responses] == alone
    if batching == "batches":
        # They were collected together and split by search settings: the three beam-3 requests of the
        # same length limit share one batch, each other request has its own.
        assert stats["batches"] == len(MIXED) - 2, stats
    else:  # the four beam searches in the continuous search (two of its searches: two length limits), the rest in batches
        assert stats["continuous_requests"] == 4 and stats["batches"] == len(MIXED) - 4, stats
    assert len({a["translations"][1] for a in alone}) >= 6, "the settings must change the outputs for this test to mean much"


LONG = "Two children play with a red ball. " * 28  # 980 characters, 672 tokens for the random model's tokenizer


def units_asked(checkpoint_dir, bodies: list[dict]) -> list[int]:
    """The units of work the server says each body asks for: in the 422 of a server that allows 1 (or 1,
    if that server translates it)."""
    responses, _ = exchange(checkpoint_dir, bodies, max_request_work=1, max_queue_work=1)
    found = [re.search(r"asks for (\d+) units", r.text) for r in responses]
    assert all(f or r.status_code == 200 for f, r in zip(found, responses)), [r.text[:300] for r in responses]
    return [int(f.group(1)) if f else 1 for f in found]


def test_each_request_is_served_at_exactly_its_work_and_refused_one_unit_below(random_checkpoint):
    bodies = [
        {"texts": ["Two children play with a red ball."], **options}
        for options in ({"beam_size": 1}, {"beam_size": 1, "n_best": 1}, {"beam_size": 16, "n_best": 16},
                        {"sampling": True}, {"sampling": True, "top_p": 0.9}, {"beam_size": 2, "attention": True},
                        {"beam_size": 2, "confidence": True}, {"beam_size": 1, "attention": True, "confidence": True})
    ]
    for body, units in zip(bodies, units_asked(random_checkpoint, bodies)):
        responses, stats = exchange(random_checkpoint, [body, body], max_request_work=units, max_queue_work=units)
        assert [r.status_code for r in responses] == [200, 200], (body, units, [r.text for r in responses])
        (refused,), _ = exchange(random_checkpoint, [body], max_request_work=units - 1, max_queue_work=units)
        assert refused.status_code == 422, (body, units, refused.text)
        (problem,) = refused.json()["detail"]
        assert problem["loc"] == ["body", "texts"] and problem["type"] == "too_much_work"
        assert f"asks for {units} units" in problem["msg"] and "--max-request-work" in problem["msg"], problem


def measured_flops(batcher, body: dict) -> int:
    """Floating-point operations of the matrix products the server's model thread runs for ``body``:
    the search, the scores and the attention it asks for, with a model that never says EOS (so every
    search runs to its limit, the worst case a charge must cover). Counted on F.linear (oneDNN's
    products are invisible to the counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    from qkv.model import kernels
    from qkv.serve.batcher import Job
    from qkv.serve.api import request_model, settings_of

    model, tok = batcher.model, batcher.tokenizer
    request = request_model(max_texts=64, max_chars=1000, max_output=model.config.max_len - 1, vocab_size=tok.vocab_size)
    settings = settings_of(request(**body))
    src_ids = [ids[: model.config.max_len - 1] for ids in tok.encode_batch(body["texts"])]
    loop = asyncio.new_event_loop()
    job = Job(body["texts"], src_ids, settings, batcher.work(src_ids, settings), loop.create_future())
    no_eos = model.generator.register_forward_hook(
        lambda module, inputs, out: out.index_fill(-1, torch.tensor([tok.eos_id]), float("-inf")))
    onednn = kernels.prefer_onednn(False)
    try:
        with FlopCounterMode(display=False) as counter:
            batcher.translate_group(settings.search(), [job])
    finally:
        kernels.prefer_onednn(onednn)
        no_eos.remove()
        loop.close()
    return counter.get_total_flops()


def test_the_work_charged_ranks_requests_as_their_measured_cost(random_checkpoint):
    """The charge follows what the server computes: of two requests whose matrix products differ 3x
    or more, the costlier is charged more. Among them 64 one-word texts and 64 texts of 672 tokens,
    both at max_length 1: alike for the decoder, 60x apart for the encoder."""
    app = create_app(random_checkpoint)
    batcher = app.state.batcher
    requests = {
        "1 short, greedy, 10 tokens": {"texts": ["A dog runs."], "beam_size": 1, "max_length": 10},
        "1 short, greedy scored, 10 tokens": {"texts": ["A dog runs."], "beam_size": 1, "n_best": 1, "max_length": 10},
        "64 short, max_length 1": {"texts": ["A dog."] * 64, "beam_size": 1, "max_length": 1},
        "64 long, max_length 1": {"texts": [LONG] * 64, "beam_size": 1, "max_length": 1},
        "1 long, max_length 1": {"texts": [LONG], "beam_size": 1, "max_length": 1},
        "1 long, max_length 1, attention": {"texts": [LONG], "beam_size": 1, "max_length": 1, "attention": True},
        "1 long, max_length 1, confidence": {"texts": [LONG], "beam_size": 1, "max_length": 1, "confidence": True},
        "64 short, max_length 1, confidence": {"texts": ["A dog."] * 64, "beam_size": 1, "max_length": 1, "confidence": True},
        "1 short, beam 16, 60 tokens": {"texts": ["A dog runs."], "beam_size": 16, "max_length": 60},
        "8 short, beam 4, 40 tokens": {"texts": ["Two children play with a red ball."] * 8, "beam_size": 4, "max_length": 40},
        "4 long, beam 2, 200 tokens": {"texts": [LONG] * 4, "beam_size": 2, "max_length": 200},
    }
    charged = dict(zip(requests, units_asked(random_checkpoint, list(requests.values()))))
    flops = {name: measured_flops(batcher, body) for name, body in requests.items()}
    wrong = [(a, b) for a in requests for b in requests if flops[a] >= 3 * flops[b] and not charged[a] > charged[b]]
    assert not wrong, "\n".join(f"{a}: {flops[a]:,} FLOPs, {charged[a]} units; {b}: {flops[b]:,} FLOPs, {charged[b]} units"
                                for a, b in wrong)
    assert flops["64 long, max_length 1"] > 30 * flops["64 short, max_length 1"], flops  # the case that was charged alike


def test_attention_pays_for_every_weight_it_computes(random_checkpoint, monkeypatch):
    """With "attention": true the server computes every attention weight of one more pass, the
    encoder's self-attention included (layers x heads x S x S: about a million for one long text at
    max_length 1, where the weights returned are 2 x S per head and layer). Counted as they are made,
    each thousand costs at least a unit more than the same request without attention."""
    import qkv.model.attention

    made = []
    attend = qkv.model.attention.scaled_dot_product_attention

    def counting(*args, **kwargs):
        out, weights = attend(*args, **kwargs)
        if weights is not None:
            made.append(weights.numel())
        return out, weights

    monkeypatch.setattr(qkv.model.attention, "scaled_dot_product_attention", counting)
    body = {"texts": [LONG, LONG], "beam_size": 1, "max_length": 1}
    with_attention, without = units_asked(random_checkpoint, [{**body, "attention": True}, body])
    assert answers(random_checkpoint, [{**body, "attention": True}])[0]["attention"]
    assert sum(made) > 1_000_000, made  # the test needs the encoder's weights to dominate
    assert with_attention - without >= sum(made) / 1000, (with_attention, without, sum(made))


def test_long_sources_at_max_length_1_are_charged_for_their_source_tokens(random_checkpoint):
    """64 texts of 672 tokens at max_length 1 decode 64 tokens but encode 43,000: over the default limit
    of 20,000 units. The same texts fit a server that allows their work, and wait in its queue as that much."""
    body = {"texts": [LONG] * 64, "beam_size": 1, "max_length": 1}
    (refused,), stats = exchange(random_checkpoint, [body])
    assert refused.status_code == 422, refused.text
    (problem,) = refused.json()["detail"]
    assert problem["type"] == "too_much_work" and "--max-request-work" in problem["msg"], problem
    assert re.search(r"\b(4\d{4}) for source tokens, 64 for output tokens", problem["msg"]), problem
    assert stats["requests"] == 0  # refused before it was queued
    # A queue with room for the work of one such request, and a second one at once: 503.
    app = create_app(random_checkpoint, max_request_work=50_000, max_queue_work=50_000, max_wait_ms=0)

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=60) as client:
                return await asyncio.gather(*[client.post("/v1/translate", json=body) for _ in range(2)])

    statuses = sorted(r.status_code for r in asyncio.run(scenario()))
    assert statuses == [200, 503], statuses


def test_confidence_is_the_one_qkv_score_gives_with_flags_their_reasons_and_word_marks(random_checkpoint, loaded):
    """"confidence": true answers, per text, what `qkv score --confidence` says of the same pair (one
    qkv.inspect.trust.assess over the server's own translations, with the checkpoint's calibration)."""
    from qkv.inspect.trust import FLAG_FEATURE, FLAGS, assess, calibration_of

    (body,) = answers(random_checkpoint, [{"texts": TEXTS, "beam_size": 2, "confidence": True}])
    expected = assess(loaded.model, loaded.tokenizer, TEXTS, body["translations"],
                      calibration=calibration_of(loaded.path))
    assert len(body["confidence"]) == len(TEXTS)
    for got, want, translation in zip(body["confidence"], expected, body["translations"]):
        assert got["confidence"] == pytest.approx(want.confidence, abs=1e-4) and 0 <= got["confidence"] <= 1
        assert got["flags"] == want.flags and set(got["flags"]) <= set(FLAGS)
        assert set(got["why"]) == set(got["flags"]), got
        assert [w["word"] for w in got["words"]] == translation.split()
        assert all(w["marked"] == (w["prob"] < 0.05 or w["source"] < 0.25) for w in got["words"])
    for t in body["confidence"]:  # each reason names its feature and gives its value (which lines a
        for flag in t["flags"]:   # random model's output gets flagged on varies with the host's numerics)
            feature = FLAG_FEATURE[flag][0]
            assert f"({feature}) is {t['features'][feature]:.3f}" in t["why"][flag], t
    (plain,) = answers(random_checkpoint, [{"texts": TEXTS, "beam_size": 2}])
    assert "confidence" not in plain and plain["translations"] == body["translations"]


def test_attention_comes_with_the_contributions_of_the_same_pass(random_checkpoint, loaded):
    """Each attention object holds ALTI+'s source columns per decoder layer, (L, T, S), as
    qkv.inspect.contributions computes them: rows between 0 and 1, the rest being the target prefix's."""
    from qkv.inspect.contributions import contributions

    text = TEXTS[1]
    (body,) = answers(random_checkpoint, [{"texts": [text], "beam_size": 2, "attention": True}])
    (capture,) = body["attention"]
    model, tok = loaded.model.eval(), loaded.tokenizer
    src_ids = tok.encode(text)
    config = DecodeConfig(beam_size=2, **checkpoint.decode_defaults(loaded.config))
    hyp = Translator(model, tok, config).translate_ids([src_ids])[0][0].tokens  # what the server translated
    assert tok.decode(hyp) == body["translations"][0]
    src = collate_sources([src_ids], pad_id=tok.pad_id, eos_id=tok.eos_id)
    found = contributions(model, src, torch.tensor([[tok.bos_id, *hyp]]))
    S = src.size(1)
    want = torch.stack([a[0, :, :S] for a in found.alti])  # (L, T, S)
    got = torch.tensor(capture["contributions"])
    assert got.shape == want.shape == (model.config.n_decoder_layers, len(capture["tgt_tokens"]), len(capture["src_tokens"]))
    assert torch.allclose(got, want.float(), atol=1e-4)
    assert ((got.sum(-1) > 0) & (got.sum(-1) <= 1 + 1e-3)).all()
    assert torch.allclose(torch.tensor(capture["cross"]), torch.stack([w[0] for w in found.weights]).float(), atol=1e-4)


def test_a_text_that_made_the_splitter_panic_is_translated_with_the_others(random_checkpoint):
    # "Plan B\u00a0." made sentencex panic: a plain-text 500, the other texts lost, not counted (issue 72, #15)
    texts = ["A dog runs.", "Plan B\u00a0.", "TWO CHILDREN PLAY. A cat sleeps."]
    (response,), stats = exchange(random_checkpoint, [{"texts": texts, "beam_size": 1}])
    assert response.status_code == 200, response.text
    assert len(response.json()["translations"]) == 3 and stats["failed"] == 0
    (alone,), _ = exchange(random_checkpoint, [{"texts": texts[:1], "beam_size": 1}])
    assert response.json()["translations"][0] == alone.json()["translations"][0]


@pytest.mark.parametrize("searches", [1, 2])
def test_batches_are_searched_side_by_side_in_as_many_threads_as_searches(random_checkpoint, loaded, searches):
    # Eight requests at once, at most two sentences a batch: four batches. With searches=2 two of them are
    # decoded at the same time, in two threads; with 1, one at a time. The answers are the library's either way.
    import threading
    import time

    texts = ["A dog runs.", "Two children play.", "A man rides a bike.", "The sun shines.",
             "A cat sleeps.", "Birds fly south.", "Rain falls.", "A boy reads a book."]
    app = create_app(random_checkpoint, searches=searches, max_batch_sentences=2, max_wait_ms=50)
    model = app.state.batcher.search_model
    inside, most, threads, lock = [0], [0], set(), threading.Lock()

    def enter(module, args):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            threads.add(threading.get_ident())
        time.sleep(0.002)  # each decoding step takes a while, so that batches overlap if they can

    def leave(module, args, output):
        with lock:
            inside[0] -= 1

    hooks = [model.generator.register_forward_pre_hook(enter), model.generator.register_forward_hook(leave)]

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=60) as client:
                return await asyncio.gather(*[client.post("/v1/translate", json={"texts": [t], "beam_size": 3}) for t in texts])

    try:
        responses = asyncio.run(scenario())
    finally:
        for hook in hooks:
            hook.remove()
    assert [r.status_code for r in responses] == [200] * len(texts)
    expected = Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=3), max_tokens=4096, max_sentences=32).translate(texts)
    assert [r.json()["translations"][0] for r in responses] == expected
    assert most[0] == searches and len(threads) == searches

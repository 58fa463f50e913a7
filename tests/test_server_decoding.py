"""`qkv serve` beyond beam search: n-best lists with scores, sampling under a seed, the work these ask
for, and requests with different settings batched together.

The app runs in this process (httpx's ASGI transport, the batcher's real worker thread) on the
session's random checkpoint (tests/conftest.py), which translates in milliseconds. The checks that an
invalid option answers 422 are with the others in tests/test_server.py (BAD_REQUESTS).
"""

import asyncio
import math

import httpx
import pytest

from qkv import checkpoint
from qkv.decode import DecodeConfig, beam_search
from qkv.server import create_app
from qkv.translate import Translator, collate_sources

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


def test_requests_with_different_settings_batched_together_get_what_they_get_alone(random_checkpoint):
    alone = answers(random_checkpoint, MIXED)
    responses, stats = exchange(random_checkpoint, MIXED, together=True, max_wait_ms=500)
    assert [r.status_code for r in responses] == [200] * len(MIXED)
    assert [r.json() for r in responses] == alone
    # They were collected together and split by search settings: the three beam-3 requests of the
    # same length limit share one batch, each other request has its own.
    assert stats["batches"] == len(MIXED) - 2, stats
    assert len({a["translations"][1] for a in alone}) >= 6, "the settings must change the outputs for this test to mean much"


def test_the_work_of_a_request_counts_the_beam_sampling_and_scoring(random_checkpoint, loaded):
    text = "Two children play with a red ball."
    T = min(int(1.5 * (len(loaded.tokenizer.encode(text)) + 1) + 10), loaded.model.config.max_len - 1)  # most output tokens
    units = {  # units of work per output token
        "greedy": ({"beam_size": 1}, 1),
        "greedy, scored": ({"beam_size": 1, "n_best": 1}, 2),
        "beam 4, n-best 4": ({"beam_size": 4, "n_best": 4}, 4),
        "beam 16, n-best 16": ({"beam_size": 16, "n_best": 16}, 16),
        "sampling": ({"sampling": True}, 1),
        "sampling, scored": ({"sampling": True, "n_best": 1}, 2),
        "top_k": ({"sampling": True, "top_k": 10}, 2),
        "top_p": ({"sampling": True, "top_p": 0.9}, 12),
    }
    bodies = [{"texts": [text], **options} for options, _ in units.values()]
    # Each request is served under a limit of exactly its work and refused one unit below it.
    for max_work in sorted({u * T + below for _, u in units.values() for below in (-1, 0)}):
        responses, stats = exchange(random_checkpoint, bodies, max_request_work=max_work, max_queue_work=max_work)
        for name, response, (_, u) in zip(units, responses, units.values()):
            if u * T <= max_work:
                assert response.status_code == 200, (name, max_work, response.text)
                continue
            assert response.status_code == 422, (name, max_work, response.text)
            (problem,) = response.json()["detail"]
            assert problem["loc"] == ["body", "texts"] and problem["type"] == "too_much_work"
            assert f"asks for {u * T} units" in problem["msg"] and "--max-request-work" in problem["msg"], problem
        assert stats["requests"] == sum(u * T <= max_work for _, u in units.values())

"""`qkv serve`: the HTTP API, dynamic batching, limits, shutdown, the page in a real browser, fuzzing.

Most tests talk to a real server process (`python -m qkv serve`) on 127.0.0.1 with a real HTTP
client, serving a tiny model trained here on the generated dates task (no corpus needed).
"""

import asyncio
import hashlib
import importlib.util
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from qkv.io import checkpoint
from qkv.infer.search import DecodeConfig
from qkv.serve.app import create_app
from qkv.infer.translator import Translator
from qkv.inspect.visualize import capture_attention

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("load_test", ROOT / "benchmarks" / "load_test.py")
load_test = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load_test)
_spec = importlib.util.spec_from_file_location("hostile_client", ROOT / "benchmarks" / "hostile_client.py")
hostile_client = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostile_client)

# Inputs the tiny dates model tells apart, so a shuffled answer would be caught.
DATES = ["9 mai 2017", "3. Oktober 1990", "le 14 juillet 1989", "Tuesday, 9th of May 2017", "21/12/55", "1 enero 2042"]

# A server whose model takes `SLOW_S` longer per batch, to have requests in flight on purpose.
SLOW_S = 1.5
SLOW_PRELUDE = f"""
import time
import qkv.serve.app as server
_translate_group = server.Batcher.translate_group
def _slow(self, *args):
    time.sleep({SLOW_S})
    return _translate_group(self, *args)
server.Batcher.translate_group = _slow
import qkv.infer.continuous as continuous
_add = continuous.ContinuousBeamSearch.add
def _slow_add(self, *args):
    time.sleep({SLOW_S})
    return _add(self, *args)
continuous.ContinuousBeamSearch.add = _slow_add
"""

# A server whose model never emits EOS, so every search runs to its maximum length: the worst case
# that --max-request-work bounds. Each decoding step sleeps `step_s` more, to make the work long.
NEVER_STOP_PRELUDE = """
import time
import torch
import qkv.io.checkpoint as checkpoint
_load = checkpoint.load
def _load_never_stop(*args, **kwargs):
    loaded = _load(*args, **kwargs)
    eos = loaded.tokenizer.eos_id
    def no_eos(module, inputs, output):
        time.sleep({step_s})
        return output.index_fill(-1, torch.tensor([eos]), float("-inf"))
    loaded.model.generator.register_forward_hook(no_eos)
    return loaded
checkpoint.load = _load_never_stop
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Transformer trained for 40 steps on generated dates (a few seconds)."""
    from qkv.inspect.demo import train_dates_model
    from qkv.train.recipes import TrainConfig

    out = tmp_path_factory.mktemp("dates")
    train = TrainConfig(max_tokens=1000, lr=3e-3, warmup_steps=10, eval_every=40, max_steps=40, average_last=1, keep_last=1)
    train_dates_model(out, n_train=400, n_valid=10, n_test=0, seed=1, train=train, progress=False)
    return out / "final"


@pytest.fixture(scope="module")
def loaded(model_dir):
    return checkpoint.load(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    # --loop-guard 0: the exact search, which the expected translations (the library's Translator) run
    with load_test.ServerProcess(model_dir, "--max-wait-ms", "20", "--log-level", "info", "--loop-guard", "0", log_path=log) as process:
        yield process


def post(server, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/translate", json=body, timeout=60, **kwargs)


def expected_translations(loaded, texts: list[str], beam_size: int) -> list[str]:
    # The server's batch settings (defaults of `qkv serve`), so one request alone is batched identically.
    translator = Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=beam_size), max_tokens=4096, max_sentences=32)
    return translator.translate(texts)


def test_translations_come_back_in_input_order(server, loaded):
    texts = [*DATES, ""]
    expected = expected_translations(loaded, texts, beam_size=5)
    assert len(set(expected)) >= 4, f"the model must tell the inputs apart for this test to mean anything: {expected}"
    response = post(server, {"texts": texts})
    assert response.status_code == 200
    assert response.json() == {"translations": expected}  # no "attention" unless asked
    assert expected[-1] == ""
    reverse = post(server, {"texts": texts[::-1]}).json()["translations"]
    assert reverse == expected[::-1]


def test_attention_comes_with_tokens_and_shapes(server, loaded):
    model, tok = loaded.model, loaded.tokenizer
    L, H = model.config.n_decoder_layers, model.config.n_heads
    texts = DATES[:2]
    body = post(server, {"texts": texts, "beam_size": 2, "attention": True}).json()
    assert len(body["attention"]) == len(texts)
    for text, translation, att in zip(texts, body["translations"], body["attention"]):
        assert att["source"] == text and att["translation"] == translation
        assert att["src_tokens"] == tok.pieces([*tok.encode(text), tok.eos_id])
        assert att["tgt_tokens"][-1] == "</s>"
        cross = torch.tensor(att["cross"])
        T, S = len(att["tgt_tokens"]), len(att["src_tokens"])
        assert cross.shape == (L, H, T, S)
        torch.testing.assert_close(cross.sum(-1), torch.ones(L, H, T), atol=2e-3, rtol=0)
        # The weights are those of this very translation, as qkv attend captures them.
        capture = capture_attention(model, tok, text, DecodeConfig(beam_size=2))
        assert capture.translation == translation and capture.tgt_tokens == att["tgt_tokens"]
        torch.testing.assert_close(cross, capture.cross, atol=1e-4, rtol=0)
        # Asking for attention does not change the translation.
        assert post(server, {"texts": [text], "beam_size": 2}).json()["translations"] == [translation]


def test_model_info_names_the_checkpoint(server, loaded, model_dir):
    answer = httpx.get(f"{server.url}/v1/model")
    info = answer.json()
    # The directory's name, not where it lies on the server's disk (which is no client's business).
    assert info["checkpoint"] == model_dir.resolve().name and "/" not in info["checkpoint"]
    assert str(model_dir.resolve().parent) not in answer.text and str(model_dir.parent) not in answer.text
    assert info["sha256"] == hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()[:16]
    assert info["parameters"] == loaded.model.num_parameters()
    assert info["vocab_size"] == loaded.tokenizer.vocab_size
    assert (info["d_model"], info["n_heads"]) == (loaded.model.config.d_model, loaded.model.config.n_heads)
    assert (info["src_lang"], info["tgt_lang"]) == (loaded.config["data"]["src_lang"], loaded.config["data"]["tgt_lang"])
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert "/v1/translate" in httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert httpx.get(f"{server.url}/docs").status_code == 200


BAD_REQUESTS = {
    "empty list": ({"texts": []}, ["body", "texts"]),
    "too many texts": ({"texts": ["a"] * 65}, ["body", "texts"]),
    "text too long": ({"texts": ["ok", "a" * 1001]}, ["body", "texts", 1]),
    "texts not a list": ({"texts": "a sentence"}, ["body", "texts"]),
    "number as text": ({"texts": [42]}, ["body", "texts", 0]),
    "texts missing": ({}, ["body", "texts"]),
    "unknown field": ({"texts": ["a"], "beam": 3}, ["body", "beam"]),
    "beam 0": ({"texts": ["a"], "beam_size": 0}, ["body", "beam_size"]),
    "beam 17": ({"texts": ["a"], "beam_size": 17}, ["body", "beam_size"]),
    "beam as string": ({"texts": ["a"], "beam_size": "5"}, ["body", "beam_size"]),
    "beam as bool": ({"texts": ["a"], "beam_size": True}, ["body", "beam_size"]),
    "fractional beam": ({"texts": ["a"], "beam_size": 2.5}, ["body", "beam_size"]),
    "max_length 0": ({"texts": ["a"], "max_length": 0}, ["body", "max_length"]),
    "attention as string": ({"texts": ["a"], "attention": "yes"}, ["body", "attention"]),
    "n_best 0": ({"texts": ["a"], "n_best": 0}, ["body", "n_best"]),
    "n_best 17": ({"texts": ["a"], "n_best": 17}, ["body", "n_best"]),
    "n_best over the beam": ({"texts": ["a"], "beam_size": 3, "n_best": 4}, ["body", "n_best"]),
    "n_best over the default beam": ({"texts": ["a"], "n_best": 6}, ["body", "n_best"]),
    "n_best as string": ({"texts": ["a"], "n_best": "2"}, ["body", "n_best"]),
    "sampling as string": ({"texts": ["a"], "sampling": "true"}, ["body", "sampling"]),
    "sampling with a beam": ({"texts": ["a"], "sampling": True, "beam_size": 4}, ["body", "beam_size"]),
    "sampling n_best 2": ({"texts": ["a"], "sampling": True, "n_best": 2}, ["body", "n_best"]),
    "temperature without sampling": ({"texts": ["a"], "temperature": 0.7}, ["body", "temperature"]),
    "top_k without sampling": ({"texts": ["a"], "top_k": 5}, ["body", "top_k"]),
    "top_p without sampling": ({"texts": ["a"], "top_p": 0.9}, ["body", "top_p"]),
    "seed without sampling": ({"texts": ["a"], "sampling": False, "seed": 3}, ["body", "seed"]),
    "temperature 0": ({"texts": ["a"], "sampling": True, "temperature": 0}, ["body", "temperature"]),
    "temperature 1000": ({"texts": ["a"], "sampling": True, "temperature": 1000}, ["body", "temperature"]),
    "temperature as string": ({"texts": ["a"], "sampling": True, "temperature": "0.5"}, ["body", "temperature"]),
    "temperature NaN": (b'{"texts": ["a"], "sampling": true, "temperature": NaN}', ["body", "temperature"]),
    "top_p 0": ({"texts": ["a"], "sampling": True, "top_p": 0}, ["body", "top_p"]),
    "top_p 1.5": ({"texts": ["a"], "sampling": True, "top_p": 1.5}, ["body", "top_p"]),
    "top_p Infinity": (b'{"texts": ["a"], "sampling": true, "top_p": Infinity}', ["body", "top_p"]),
    "top_k negative": ({"texts": ["a"], "sampling": True, "top_k": -1}, ["body", "top_k"]),
    "top_k over the vocabulary": ({"texts": ["a"], "sampling": True, "top_k": 10**6}, ["body", "top_k"]),
    "fractional top_k": ({"texts": ["a"], "sampling": True, "top_k": 2.5}, ["body", "top_k"]),
    "seed negative": ({"texts": ["a"], "sampling": True, "seed": -1}, ["body", "seed"]),
    "seed 2**64": ({"texts": ["a"], "sampling": True, "seed": 2**64}, ["body", "seed"]),
    "body a list": (["a"], ["body"]),
    "invalid JSON": (b'{"texts": [', ["body", 11]),
    "lone surrogate": (b'{"texts": ["\\ud800"]}', ["body", "texts", 0]),
    "glossary entry without a target": ({"texts": ["a"], "glossary": [["dog"]]}, ["body", "glossary", 0]),
    "glossary term empty": ({"texts": ["a"], "glossary": [["dog", ""]]}, ["body", "glossary", 0, 1]),
    "glossary term as number": ({"texts": ["a"], "glossary": [["dog", 3]]}, ["body", "glossary", 0, 1]),
    "glossary too long": ({"texts": ["a"], "glossary": [[f"w{i}", "x"] for i in range(1001)]}, ["body", "glossary"]),
    "glossary term listed twice": ({"texts": ["a"], "glossary": [["dog", "Hund"], ["Dog", "Hunde"]]}, ["body", "glossary"]),
    "glossary with n_best": ({"texts": ["a"], "glossary": [["dog", "Hund"]], "n_best": 1}, ["body", "glossary"]),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_requests_get_a_clear_422(server, case):
    body, location = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        response = httpx.post(f"{server.url}/v1/translate", content=body, headers={"content-type": "application/json"})
    else:
        response = post(server, body)
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/json"
    problems = response.json()["detail"]
    assert problems and all(p["msg"] for p in problems)
    assert location in [p["loc"] for p in problems], problems
    assert "input" not in problems[0]  # the input is not echoed back (it may be 64 KB)
    if problems[0]["type"] == "invalid_combination":  # options valid alone, not together: say which and why
        assert location[-1] in problems[0]["msg"], problems


def test_integral_float_is_a_valid_beam_size(server):
    # JSON Schema counts 2.0 as an integer; the fuzzer sends it and expects it to be accepted.
    assert post(server, {"texts": ["9 mai 2017"], "beam_size": 2.0}).status_code == 200
    assert post(server, {"texts": ["9 mai 2017"], "beam_size": 2, "n_best": 2.0}).status_code == 200


def test_sampling_options_at_their_defaults_are_accepted_without_sampling(server):
    # A client (a form) may send every field: the defaults ask for nothing, so they are no error.
    defaults = {"temperature": 1.0, "top_k": 0, "top_p": 1, "seed": 0}
    with_defaults = post(server, {"texts": DATES[:2], "sampling": False, **defaults})
    assert with_defaults.status_code == 200
    assert with_defaults.json() == post(server, {"texts": DATES[:2]}).json()


def test_full_queue_answers_503_with_retry_after(model_dir):
    app = create_app(model_dir, max_queue=1, max_batch_sentences=1, max_wait_ms=0)
    batcher = app.state.batcher
    translate_group = batcher.translate_group

    def slow(*args):
        time.sleep(0.3)
        return translate_group(*args)

    batcher.translate_group = slow

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=30) as client:
                requests = [client.post("/v1/translate", json={"texts": [d], "beam_size": 1}) for d in DATES]
                responses = await asyncio.gather(*requests)
                stats = (await client.get("/v1/stats")).json()
        return responses, stats

    responses, stats = asyncio.run(scenario())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 503}, statuses
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert "queue is full" in r.json()["detail"]
        else:
            assert len(r.json()["translations"]) == 1
    assert stats["rejected"] == statuses.count(503)
    assert stats["requests"] == statuses.count(200)


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server, loaded):
    texts = [f"{day} mai {1950 + 5 * day}" for day in range(1, 17)]
    expected = expected_translations(loaded, texts, beam_size=1)
    assert len(set(expected)) >= 4, expected
    before = httpx.get(f"{server.url}/v1/stats").json()

    async def clients():
        async with httpx.AsyncClient(timeout=60) as client:
            requests = [client.post(f"{server.url}/v1/translate", json={"texts": [t], "beam_size": 1}) for t in texts]
            return await asyncio.gather(*requests)

    responses = asyncio.run(clients())
    assert [r.status_code for r in responses] == [200] * len(texts)
    assert [r.json()["translations"][0] for r in responses] == expected
    after = httpx.get(f"{server.url}/v1/stats").json()
    batches = after["batches"] - before["batches"]
    assert (after["sentences"] - before["sentences"]) / batches > 1, f"16 requests in {batches} batches"


def test_small_load_test_has_no_errors_and_batches(server):
    result = asyncio.run(load_test.run_load(server.url, clients=8, requests=5, beam=1, max_seconds=120))
    assert result["errors"] == 0, result["error_examples"]
    assert result["ok"] == 40
    assert result["mean_batch_size"] > 1
    assert result["p50_ms"] <= result["p99_ms"]


def test_clients_that_disconnect_do_not_disturb_others(server):
    request = b'{"texts": ["9 mai 2017", "3. Oktober 1990", "le 14 juillet 1989"], "beam_size": 4}'
    head = f"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(request)}\r\n\r\n"
    log_before = len(server.log_path.read_text())

    def hang_up(partial: bool) -> None:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(head.encode() + (request[:10] if partial else request))
        # closed at once: before the answer (or before the rest of the body)

    async def everyone():
        async with httpx.AsyncClient(timeout=60) as client:
            polite = [client.post(f"{server.url}/v1/translate", json={"texts": [d], "beam_size": 4}) for d in DATES]
            rude = [asyncio.to_thread(hang_up, i % 2 == 1) for i in range(8)]
            results = await asyncio.gather(*polite, *rude)
        return results[: len(DATES)]

    responses = asyncio.run(everyone())
    assert [r.status_code for r in responses] == [200] * len(DATES)
    time.sleep(0.5)  # let the server finish the abandoned requests
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert post(server, {"texts": ["9 mai 2017"]}).status_code == 200
    new_log = server.log_path.read_text()[log_before:]
    assert "Traceback" not in new_log and "ERROR" not in new_log, new_log


@pytest.mark.parametrize("batching", ["continuous", "batches"])
def test_sigterm_lets_in_flight_requests_finish(model_dir, tmp_path, batching):
    log = tmp_path / "server.log"
    server = load_test.ServerProcess(model_dir, "--log-level", "info", "--batching", batching, log_path=log, prelude=SLOW_PRELUDE).start()
    results: dict[int, tuple[float, httpx.Response]] = {}

    def call(beam: int) -> None:  # different beams: two batches, the second waits for the first
        response = httpx.post(f"{server.url}/v1/translate", json={"texts": DATES[:3], "beam_size": beam}, timeout=60)
        results[beam] = (time.monotonic(), response)

    try:
        threads = [threading.Thread(target=call, args=(beam,)) for beam in (1, 2)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/v1/stats").json()["requests"] < 2:
            assert time.monotonic() < deadline, "the requests never reached the server"
            time.sleep(0.02)
        signalled = time.monotonic()
        server.terminate()
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no new connections while draining
            httpx.get(f"{server.url}/health", timeout=2)
        for thread in threads:
            thread.join(30)
        # uvicorn re-raises the signal once it has shut down cleanly, so the status is "killed by SIGTERM".
        assert server.process.wait(30) in (0, -signal.SIGTERM)
    finally:
        server.stop()
    for beam in (1, 2):
        finished, response = results[beam]
        assert finished > signalled  # it really was in flight at SIGTERM
        assert response.status_code == 200
        assert len(response.json()["translations"]) == 3
    text = log.read_text()
    assert "Application shutdown complete" in text and "Traceback" not in text, text


def test_page_is_self_contained(server):
    response = httpx.get(f"{server.url}/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "<textarea" in page and "/v1/translate" in page and "attention: true" in page
    assert not re.search(r"(src|href)=\"(https?:)?//", page), "the page must not load anything from elsewhere"


def test_page_translates_and_shows_attention_in_chromium(server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    sentence = DATES[0]
    api = post(server, {"texts": [sentence], "beam_size": 5, "attention": True}).json()
    cross = torch.tensor(api["attention"][0]["cross"])  # (L, H, T, S)
    T = cross.size(2)
    assert T >= 2, "need at least one target token besides EOS"

    browser.get(server.url + "/")
    box = browser.find_element(By.ID, "input")
    box.clear()
    box.send_keys(sentence)
    browser.find_element(By.ID, "translate").click()
    wait = WebDriverWait(browser, 30)
    shown = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#results .translation"))
    assert [s.get_attribute("textContent") for s in shown] == api["translations"]
    wait.until(lambda d: "parameters" in d.find_element(By.ID, "model").text)

    def weights_shown() -> list[float | None]:
        tokens = browser.find_elements(By.CSS_SELECTOR, "#src-strip .src-tok")
        assert [t.get_attribute("textContent") for t in tokens] == api["attention"][0]["src_tokens"]
        return [None if t.get_attribute("data-weight") is None else float(t.get_attribute("data-weight")) for t in tokens]

    def hover_target(t: int) -> None:
        token = browser.find_elements(By.CSS_SELECTOR, "#tgt-strip .tgt-tok")[t]
        ActionChains(browser).move_to_element(token).perform()
        wait.until(lambda d: "hot" in d.find_elements(By.CSS_SELECTOR, "#tgt-strip .tgt-tok")[t].get_attribute("class"))

    assert weights_shown() == [None] * cross.size(3)  # nothing lit before a hover
    for t in (0, T - 1):  # default view: last layer, average of heads
        hover_target(t)
        torch.testing.assert_close(torch.tensor(weights_shown()), cross[-1, :, t].mean(0).float(), atol=2e-4, rtol=0)
        rows = browser.find_elements(By.CSS_SELECTOR, "#heatmap tr[data-index]")
        assert ["hot" in (r.get_attribute("class") or "") for r in rows] == [i == t for i in range(T)]
        colored = browser.find_elements(By.CSS_SELECTOR, "#src-strip .src-tok")[0].value_of_css_property("background-color")
        assert colored not in ("rgba(0, 0, 0, 0)", "transparent")

    L, H = cross.size(0), cross.size(1)
    labels = lambda id: [o.text for o in Select(browser.find_element(By.ID, id)).options]  # noqa: E731
    assert labels("layer") == [str(i) for i in range(1, L + 1)]  # both from 1, as qkv attend numbers them
    assert labels("head") == ["average", *[str(i) for i in range(1, H + 1)]]
    Select(browser.find_element(By.ID, "layer")).select_by_value("0")
    Select(browser.find_element(By.ID, "head")).select_by_value("1")
    hover_target(0)
    torch.testing.assert_close(torch.tensor(weights_shown()), cross[0, 1, 0].float(), atol=2e-4, rtol=0)

    # The contributions view: the same layer's ALTI+ rows, the source's share under each target token,
    # and the translation's confidence and flags (with their reasons) beside it.
    trusted = post(server, {"texts": [sentence], "beam_size": 5, "attention": True, "confidence": True}).json()
    contributions = torch.tensor(trusted["attention"][0]["contributions"])  # (L, T, S)
    Select(browser.find_element(By.ID, "view")).select_by_value("contributions")
    assert not browser.find_element(By.ID, "head").is_enabled()
    hover_target(T - 1)
    torch.testing.assert_close(torch.tensor(weights_shown()), contributions[0, T - 1], atol=2e-4, rtol=0)
    shares = [float(s.text) for s in browser.find_elements(By.CSS_SELECTOR, "#share-strip .share")]
    torch.testing.assert_close(torch.tensor(shares), contributions[0].sum(-1), atol=6e-3, rtol=0)
    (trust,) = trusted["confidence"]
    assert browser.find_element(By.CSS_SELECTOR, "#results .trust").text == f"{trust['confidence']:.2f}"
    flags = browser.find_elements(By.CSS_SELECTOR, "#results .flag")
    assert [(f.text, f.get_attribute("title")) for f in flags] == [(f, trust["why"][f]) for f in trust["flags"]]
    marked = [m.text for m in browser.find_elements(By.CSS_SELECTOR, "#results .marked")]
    assert marked == [w["word"] for w in trust["words"] if w["marked"]]
    browser.save_screenshot(str(tmp_path / "page.png"))


def test_page_sends_a_glossary_and_shows_where_each_term_went_in_chromium(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    sentence = DATES[0]  # "9 mai 2017"
    plain = post(server, {"texts": [sentence]}).json()["translations"][0]
    wanted = plain.split()[0]  # a form the model writes: "mai" asks for it
    glossary = [["mai", wanted], ["juillet", "Juli"]]  # the second is not in the sentence
    api = post(server, {"texts": [sentence], "beam_size": 5, "attention": True, "confidence": True, "glossary": glossary}).json()
    (used,) = api["terms"][0]
    assert used["source"] == "mai" and used["found"] == wanted
    browser.get(server.url + "/")
    browser.find_element(By.ID, "input").clear()
    browser.find_element(By.ID, "input").send_keys(sentence)
    browser.find_element(By.ID, "glossary").send_keys(f"mai = {wanted}\njuillet = Juli")
    browser.find_element(By.ID, "translate").click()
    wait = WebDriverWait(browser, 30)
    line = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#results .terms"))[0]
    where = "placed" if used["placed"] else "placed elsewhere"
    assert line.text.startswith(f"terms: mai → {wanted}: {where}"), line.text
    shaded = [w.text for w in browser.find_elements(By.CSS_SELECTOR, "#results .term")]
    assert shaded == [api["translations"][0].split()[j] for j in used["target_words"]]


SCHEMATHESIS_RUNS = {
    # Small limits make each fuzzed request cheap, so the fuzzer probes every bound many times.
    "small limits": (["--max-texts", "4", "--max-chars", "100"], 60),
    # The defaults, attention included: large texts, where the work and attention limits answer.
    "default limits": ([], 40),
}


@pytest.mark.parametrize("run_name", SCHEMATHESIS_RUNS, ids=list(SCHEMATHESIS_RUNS))
def test_schemathesis_finds_no_server_errors(model_dir, tmp_path, run_name):
    pytest.importorskip("schemathesis")
    executable = Path(sys.executable).parent / "schemathesis"
    if not executable.exists():
        executable = shutil.which("schemathesis")
    limits, examples = SCHEMATHESIS_RUNS[run_name]
    with load_test.ServerProcess(model_dir, *limits, "--log-level", "info", log_path=tmp_path / "server.log") as server:
        run = subprocess.run(
            [str(executable), "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error",
             "--max-examples", str(examples), "--seed", "1", "--workers", "1", "--request-timeout", "30",
             "--report", "har", "--report-har-path", str(tmp_path / "fuzz.har")],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )
        log = server.log_path.read_text()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "No issues found" in run.stdout, run.stdout[-3000:]
    assert "Traceback" not in log, log[-4000:]
    # The fuzzer did reach the translation itself, with attention, n-best lists and sampling too.
    answered = []
    for entry in json.loads((tmp_path / "fuzz.har").read_text())["log"]["entries"]:
        if entry["request"]["method"] == "POST" and entry["response"]["status"] == 200:
            answered.append(json.loads(entry["request"]["postData"]["text"]))
    assert {body.get("attention", False) for body in answered} == {True, False}, answered
    assert any("n_best" in body for body in answered) and any(body.get("sampling") for body in answered), answered


def test_cli_defaults_are_the_servers():
    from qkv.cli.main import build_parser
    from qkv.serve.app import DEFAULT_LIMITS

    args = build_parser().parse_args(["serve", "--checkpoint", "x"])
    assert {name: getattr(args, name) for name in DEFAULT_LIMITS} == DEFAULT_LIMITS


def test_searches_below_one_is_a_one_line_error_before_anything_loads(tmp_path, capsys):
    from qkv.cli.main import main

    assert main(["serve", "--checkpoint", str(tmp_path / "no-such-model"), "--searches", "0"]) != 0
    err = capsys.readouterr().err
    assert "--searches must be at least 1, got 0" in err and len(err.strip().splitlines()) == 1


LIMIT_CASES = {
    # 64 long texts at beam 16: about a million units of decoding work.
    "work": ({"texts": ["9 mai 2017 " * 90] * 64, "beam_size": 16}, ["body", "texts"], "--max-request-work"),
    # One long text with attention: few decoding steps at beam 1, but millions of weights.
    "attention": ({"texts": ["9 mai 2017 " * 90], "beam_size": 1, "attention": True}, ["body", "attention"], "--max-attention-weights"),
    # 64 long texts at max_length 1: 64 output tokens, but tens of thousands of source tokens to encode.
    "source": ({"texts": ["9 mai 2017 " * 90] * 64, "beam_size": 1, "max_length": 1}, ["body", "texts"], "--max-request-work"),
}


@pytest.mark.parametrize("case", LIMIT_CASES, ids=list(LIMIT_CASES))
def test_work_and_attention_limits_answer_422_naming_the_limit(server, case):
    body, location, flag = LIMIT_CASES[case]
    started = time.monotonic()
    response = post(server, body)
    assert response.status_code == 422, response.text
    (problem,) = response.json()["detail"]
    assert problem["loc"] == location and flag in problem["msg"], problem
    assert time.monotonic() - started < 5, "refused before any decoding"
    # Within the limit, the same kind of request is served.
    smaller = {**body, "texts": body["texts"][:1], "max_length": 20}
    assert post(server, smaller).status_code == 200


def test_body_limit_answers_413_before_reading_the_body(server):
    status, seconds = hostile_client.oversized_declared(server.url, declared=1 << 30)
    assert status == 413 and seconds < 5
    status, seconds, sent = hostile_client.oversized_chunked(server.url, total=256 << 20)
    assert status == 413 and sent < 64 << 20, sent  # it answered long before the 256 MiB were sent
    # The same limit through an ordinary client, and its message.
    response = httpx.post(f"{server.url}/v1/translate", content=b"[" * (2 << 20), headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.headers["connection"] == "close"
    assert "--max-body-bytes" in response.json()["detail"]
    # After refusing a chunked body, the server closes the connection instead of reading on.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        sock.sendall((b"%x\r\n" % (1 << 20)) + b"a" * (1 << 20) + b"\r\n" + b"1\r\na\r\n")
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes; a timeout here fails the test
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 ") and b"--max-body-bytes" in answer, answer[:300]
    # The largest body the default text limits allow (64 texts of 1000 emoji, each escaped as a
    # 12-byte surrogate pair) is under the default body limit (and the tiny model's tokenizer makes
    # each text 2 unknown tokens, so it is translated).
    largest = json.dumps({"texts": ["\U0001F600" * 1000] * 64, "beam_size": 1}, ensure_ascii=True).encode()
    assert 750_000 < len(largest) < 1 << 20
    response = httpx.post(f"{server.url}/v1/translate", content=largest, headers={"content-type": "application/json"})
    assert response.status_code == 200 and len(response.json()["translations"]) == 64, response.text[:300]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_hostile_client_leaves_health_answering_and_others_served(model_dir, tmp_path):
    """Oversized bodies, the largest requests the default limits allow, and 20 clients that send the
    largest request and hang up, against a model that never stops early: /health keeps answering
    (every probe, p99 under a second, while the flood's admitted requests hold seconds of decoding:
    a /health queued behind them would wait that long; the latencies are reported, not judged
    finer, as timings on a shared machine are not a test), the polite clients are served, and the
    flood's work is dropped."""
    prelude = NEVER_STOP_PRELUDE.format(step_s=0)
    log = tmp_path / "server.log"
    with load_test.ServerProcess(model_dir, "--log-level", "info", log_path=log, prelude=prelude) as server:
        result = asyncio.run(hostile_client.run_hostile(server.url, flood_clients=20, polite_clients=8))
    report = hostile_client.format_report(result)
    assert result["declared_1GiB"][0] == 413 and result["chunked"][0] == 413, report
    assert result["work_request"]["status"] == 200 and result["attention_request"]["status"] == 200, report
    # 2 texts x (beam 16 x 561 + at most 1,024 source tokens) <= the 20,000 limit
    assert result["work_request"]["body"]["max_length"] == 561, report
    assert [p["status"] for p in result["polite"]] == [200] * 8, report
    health = result["health"]
    assert not health["failures"] and health["n"] >= 50, report
    assert health["p99_ms"] < 1000, report
    counters = result["server"]
    flood_admitted = counters["requests"] - 2 - 8  # the rest of the flood was refused with 503
    assert flood_admitted >= 1, report
    assert counters["cancelled"] == flood_admitted, report  # every admitted flood request was dropped ...
    assert counters["sentences"] == 2 + result["attention_request"]["texts"] + 8, report  # ... untranslated
    assert counters["failed"] == 0, report
    assert "Traceback" not in log.read_text()


POISON_PRELUDE = """
import qkv.serve.app as server
_translate_group = server.Batcher.translate_group
def _poisoned(self, settings, jobs):
    if any("POISON" in text for job in jobs for text in job.texts):
        raise ValueError("secret internal detail: cannot translate POISON")
    return _translate_group(self, settings, jobs)
server.Batcher.translate_group = _poisoned
"""


def five_requests_one_poisoned(model_dir, loaded, log, args: tuple, prelude: str) -> dict:
    """Four requests of a date and one of "POISON 2017", beam 2, sent at once to a server started with
    ``args`` and ``prelude``: the four get the library's translations, the fifth a 500 that tells
    nothing; returns the server's stats."""
    expected = expected_translations(loaded, DATES[:4], beam_size=2)
    with load_test.ServerProcess(model_dir, *args, log_path=log, prelude=prelude) as server:

        async def clients():
            async with httpx.AsyncClient(timeout=60) as client:
                bodies = [{"texts": [t], "beam_size": 2} for t in DATES[:4]] + [{"texts": ["POISON 2017"], "beam_size": 2}]
                return await asyncio.gather(*[client.post(f"{server.url}/v1/translate", json=b) for b in bodies])

        *innocent, culprit = asyncio.run(clients())
        stats = httpx.get(f"{server.url}/v1/stats").json()
    assert [r.status_code for r in innocent] == [200] * 4, [r.text for r in innocent]
    assert [r.json()["translations"][0] for r in innocent] == expected
    assert culprit.status_code == 500
    assert culprit.json() == {"detail": "translation failed; the server's log has the details"}
    assert "secret internal detail" in log.read_text()  # the developer sees it, the client not
    return stats


def test_a_failing_text_fails_only_its_own_request(model_dir, loaded, tmp_path):
    log = tmp_path / "server.log"
    # A long --max-wait-ms: the five requests below arrive together and share one batch.
    # one search at a time: with two, the five would be parted between two batches as they arrive
    args = ("--max-wait-ms", "500", "--searches", "1", "--log-level", "info", "--loop-guard", "0")  # the exact search, as expected_translations
    stats = five_requests_one_poisoned(model_dir, loaded, log, args, POISON_PRELUDE)
    assert stats["failed"] == 1 and stats["batch_sizes"].get("1") == 4, stats  # retried one at a time
    assert "Traceback" in log.read_text()


LANE_PRELUDE = """
import qkv.serve.app as server
import qkv.infer.continuous as continuous
_answer, _step = server.Batcher.answer, continuous.ContinuousBeamSearch.step
def _poisoned(self, job, *args, **kwargs):
    if any("POISON" in text for text in job.texts):
        raise ValueError("secret internal detail: cannot translate POISON")
    return _answer(self, job, *args, **kwargs)
server.Batcher.answer = _poisoned
failures = {failures}
def _failing(self):
    global failures
    if failures:
        failures -= 1
        raise RuntimeError("a search that fails")
    return _step(self)
continuous.ContinuousBeamSearch.step = _failing
"""


@pytest.mark.parametrize("search_fails", [False, True], ids=["answer-fails", "search-fails-first"])
def test_a_failing_request_in_the_continuous_search_fails_alone(model_dir, loaded, tmp_path, search_fails):
    # The continuous search (--batching continuous) answers beam searches: a request whose answer fails fails alone while the
    # others' sentences go on; a search that fails hands its requests to the batches, one a batch.
    log = tmp_path / "server.log"
    args = ("--searches", "1", "--log-level", "info", "--loop-guard", "0", "--batching", "continuous")
    stats = five_requests_one_poisoned(model_dir, loaded, log, args, LANE_PRELUDE.format(failures=int(search_fails)))
    assert stats["failed"] == 1, stats
    # every request answered once: by the continuous search, or (those in the search that failed) in batches of one
    assert stats["continuous_requests"] + stats["batches"] + stats["failed"] == 5, stats
    if search_fails:
        assert stats["batches"] >= 1 and set(stats["batch_sizes"]) == {"1"} and "a continuous search of" in log.read_text(), stats
    else:
        assert stats["continuous_requests"] == 4 and stats["batches"] == 0 and stats["steps"] > 0, stats


@pytest.mark.parametrize("batching", ["batches", "continuous"])
def test_timeout_and_disconnect_stop_the_work(model_dir, tmp_path, batching):
    prelude = NEVER_STOP_PRELUDE.format(step_s=0.02)  # 620 steps: over 12 s of work per request below
    args = ("--request-timeout", "2", "--log-level", "info", "--batching", batching)
    long_request = {"texts": [DATES[0]] * 2, "beam_size": 16, "max_length": 620}  # within the 20,000 units, sources included

    def wait_for(server, key: str, value: int) -> dict:
        deadline = time.monotonic() + 5
        while (stats := httpx.get(f"{server.url}/v1/stats").json())[key] < value:
            assert time.monotonic() < deadline, f"the abandoned batch kept running: {stats}"
            time.sleep(0.05)
        return stats

    with load_test.ServerProcess(model_dir, *args, log_path=tmp_path / "server.log", prelude=prelude) as server:
        # Past --request-timeout: a 504 that names the flag, and the batch stops.
        started = time.monotonic()
        response = post(server, long_request)
        waited = time.monotonic() - started
        assert response.status_code == 504, response.text
        assert "--request-timeout" in response.json()["detail"]
        assert 2 <= waited < 6, waited
        stats = wait_for(server, "aborted_batches", 1)
        assert stats["timed_out"] == 1 and stats["sentences"] == 0, stats
        # A client that hangs up while its request is decoded: the batch stops too.
        body = json.dumps(long_request).encode()
        head = f"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", server.port)) as rude:
            rude.sendall(head.encode() + body)
            wait_for(server, "requests", 2)
            time.sleep(0.5)  # decoding now
        stats = wait_for(server, "aborted_batches", 2)
        assert stats["cancelled"] == 1 and stats["sentences"] == 0, stats
        assert post(server, {"texts": [DATES[1]], "beam_size": 1, "max_length": 5}).status_code == 200


@pytest.mark.parametrize("batching", ["batches", "continuous"])
def test_sigterm_respects_graceful_timeout(model_dir, tmp_path, batching):
    prelude = NEVER_STOP_PRELUDE.format(step_s=0.02)  # a request of over 12 s
    graceful = 2.0
    args = ("--graceful-timeout", str(graceful), "--log-level", "info", "--batching", batching)
    server = load_test.ServerProcess(model_dir, *args, log_path=tmp_path / "server.log", prelude=prelude).start()
    try:
        outcome: list = []

        def call() -> None:
            outcome.append(post(server, {"texts": [DATES[0]] * 2, "beam_size": 16, "max_length": 620}))

        thread = threading.Thread(target=call)
        thread.start()
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/v1/stats").json()["requests"] < 1:
            assert time.monotonic() < deadline, "the request never reached the server"
            time.sleep(0.02)
        time.sleep(0.5)  # now decoding
        signalled = time.monotonic()
        server.terminate()
        status = server.process.wait(graceful + 10)
        exited = time.monotonic() - signalled
        thread.join(10)
    finally:
        server.stop()
    assert status in (0, -signal.SIGTERM)
    assert graceful <= exited < graceful + 3, f"exited {exited:.1f}s after SIGTERM with --graceful-timeout {graceful}"
    (response,) = outcome  # cut off with a clear answer, not translated
    assert response.status_code == 503 and "shutting down" in response.json()["detail"], response.text
    log = (tmp_path / "server.log").read_text()
    assert "Application shutdown complete" in log and "Traceback" not in log, log


def test_a_port_in_use_is_a_one_line_error(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "qkv", "serve", "--checkpoint", str(model_dir), "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"qkv serve: error: cannot listen on 127.0.0.1:{port}: Address already in use; "
        "is another server running there? choose another --port"
    ], run.stderr


def units_asked(model_dir, body: dict) -> int:
    """The units of work the server says ``body`` asks for, in the 422 of a server that allows 1."""
    app = create_app(model_dir, max_request_work=1, max_queue_work=1)

    async def ask():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=30) as client:
            return await client.post("/v1/translate", json=body)

    return int(re.search(r"asks for (\d+) units", asyncio.run(ask()).text).group(1))


BIG = {"texts": [DATES[0]], "beam_size": 10, "max_length": 20}


def test_a_full_queue_counts_work_not_requests(model_dir):
    # Room for one request of the largest size: a second one, however small, waits no more.
    units = units_asked(model_dir, BIG)
    # in batches, whose model thread the test slows (the queue's rule is the same for the continuous search)
    app = create_app(model_dir, max_request_work=units, max_queue_work=units, max_queue=100, max_wait_ms=0, batching="batches")
    batcher = app.state.batcher
    translate_group = batcher.translate_group
    batcher.translate_group = lambda *args: (time.sleep(0.5), translate_group(*args))[1]

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=30) as client:
                big = asyncio.create_task(client.post("/v1/translate", json=BIG))
                await asyncio.sleep(0.2)
                small = await client.post("/v1/translate", json={"texts": [DATES[1]], "beam_size": 1, "max_length": 1})
                return await big, small

    big, small = asyncio.run(scenario())
    assert big.status_code == 200
    assert small.status_code == 503 and int(small.headers["retry-after"]) >= 1
    assert f"{units} units of work" in small.json()["detail"], small.json()


@pytest.mark.parametrize("batching", ["batches", "continuous"])
@pytest.mark.parametrize("twice, batches", [(False, 2), (True, 1)])
def test_a_batch_holds_at_most_max_request_work(model_dir, twice, batches, batching):
    # Two requests of beam 10 x max_length 20, sent together: one batch if the limit allows twice their work;
    # in the continuous search, searched side by side only then.
    units = units_asked(model_dir, BIG)
    max_work = 2 * units if twice else 2 * units - 1
    app = create_app(model_dir, max_request_work=max_work, max_queue_work=1000, max_wait_ms=300, batching=batching)

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=30) as client:
                responses = await asyncio.gather(*[client.post("/v1/translate", json=BIG) for _ in range(2)])
                return responses, (await client.get("/v1/stats")).json()

    responses, stats = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200, 200]
    if batching == "batches":
        assert stats["batches"] == batches, stats
    else:  # the most sentences a step decoded: one request's, or both
        assert stats["continuous_requests"] == 2 and max(map(int, stats["step_sizes"])) == len(BIG["texts"]) * (3 - batches), stats


PAGE_DOM = """
class Node {
  constructor(tag) { this.tag = tag; this.children = []; this.attrs = {}; this.style = {}; this.dataset = {};
    this.classList = {toggle() {}}; this.value = ""; this.textContent = ""; this.checked = false; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  append(...nodes) { this.children.push(...nodes); }
  replaceChildren(...nodes) { this.children = nodes; }
  addEventListener() {}
  querySelectorAll() { return []; }
}
const nodes = {};
globalThis.document = {
  getElementById: (id) => (nodes[id] = nodes[id] || new Node("div")),
  createElement: (tag) => new Node(tag),
  querySelectorAll: () => [],
};
const requests = [];  // the bodies the page posts
let reply = null;  // what the stand-in server answers
globalThis.fetch = async (url, options) => {
  if (!options) throw new Error("offline");  // GET /v1/model
  requests.push(JSON.parse(options.body));
  return {ok: true, json: async () => reply};
};
const text = (node) => typeof node === "string" ? node : node.textContent + node.children.map(text).join("");
const L = 3, H = 4, row = [[0.5, 0.5]];
const capture = {src_tokens: ["a", "</s>"], tgt_tokens: ["</s>"], cross: Array(L).fill(Array(H).fill(row)),
                 contributions: Array(L).fill(row)};
const trust = {confidence: 0.25, flags: ["copy"], why: {copy: "too close to its source"}, unused_source_words: [0],
               words: [{word: "b", prob: 0.5, source: 0.1, marked: true}]};
"""


def run_page(tmp_path, run_it: str) -> dict:
    """Run the page's script in Node with a minimal DOM stand-in (PAGE_DOM), then ``run_it``, which
    prints one JSON object."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("needs Node.js to run the page's script")
    script = re.search(r"<script>(.*)</script>", (ROOT / "qkv" / "serve" / "server.html").read_text(), re.S).group(1)
    (tmp_path / "page.js").write_text(PAGE_DOM + script + run_it)
    run = subprocess.run([node, str(tmp_path / "page.js")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_page_numbers_layers_and_heads_from_1(tmp_path):
    menus = run_page(tmp_path, """
    captures = [capture];
    trusts = [trust];
    showResults(["a"], ["b"]);
    const menu = (id) => nodes[id].children.map((o) => [o.attrs.value, o.textContent]);
    console.log(JSON.stringify({layer: menu("layer"), head: menu("head")}));
    """)
    assert menus["layer"] == [["0", "1"], ["1", "2"], ["2", "3"]]
    assert menus["head"] == [["avg", "average"], ["0", "1"], ["1", "2"], ["2", "3"], ["3", "4"]]


def test_page_asks_for_n_best_or_a_sample_and_shows_the_scores(tmp_path):
    shown = run_page(tmp_path, """
    (async () => {
      $("input").value = "a";
      $("beam").value = "4";
      $("nbest").value = "2";
      reply = {translations: ["b"], n_best: [[{translation: "b", score: -0.51}, {translation: "c", score: -0.75}]],
               attention: [capture], confidence: [trust]};
      await translate();
      const listed = text($("results"));
      $("sample").checked = true;
      $("seed").value = "7";
      reply = {translations: ["d"], attention: [capture], confidence: [trust]};
      await translate();
      console.log(JSON.stringify({requests, listed, status: $("status").textContent}));
    })();
    """)
    assert shown["requests"] == [
        {"texts": ["a"], "attention": True, "confidence": True, "beam_size": 4, "n_best": 2},
        {"texts": ["a"], "attention": True, "confidence": True, "sampling": True, "seed": 7},
    ]
    # The translation (its marked word), its confidence, its flag, the unused source word, the alternatives.
    assert shown["listed"] == "a → b0.25copysource words no target word used: a-0.5100b-0.7500c", shown
    assert "sentence(s)" in shown["status"], shown


def test_page_shows_a_split_text_joined_and_each_of_its_sentences_in_the_heatmap(tmp_path):
    """A text the server cut into sentences (issue 72, #10): the translation as answered (recased,
    joined), the words to distrust matched to the model's own (lower-case) words, the unused source
    words counted over the sentences as the model read them, and one heatmap choice per sentence."""
    shown = run_page(tmp_path, """
    (async () => {
      $("input").value = "A DOG RUNS. A cat sleeps.";
      const one = (source, translation) => Object.assign({}, capture, {source, translation});
      reply = {translations: ["EIN HUND RENNT. Eine Katze."],
               attention: [{source: "A DOG RUNS. A cat sleeps.", translation: "EIN HUND RENNT. Eine Katze.",
                            sentences: [one("A dog runs.", "Ein Hund rennt."), one("A cat sleeps.", "Eine Katze.")]}],
               confidence: [{confidence: 0.3, flags: [], why: {}, unused_source_words: [5],
                             words: ["Ein", "Hund", "rennt.", "Eine", "Katze."].map((word, j) =>
                               ({word, prob: 0.5, source: 0.5, marked: j === 1 || j === 4}))}]};
      await translate();
      const choices = nodes["sentence"].children.map((o) => o.textContent);
      const translation = nodes["results"].children[0].children[2];
      const marked = translation.children.filter((s) => typeof s !== "string" && s.attrs.class.includes("marked"));
      const first = current.source;
      choose(1);
      console.log(JSON.stringify({request: requests[0], choices, translation: text(translation),
                                  marked: marked.map((s) => s.textContent), listed: text($("results")), first, second: current.source}));
    })();
    """)
    assert shown["request"] == {"texts": ["A DOG RUNS. A cat sleeps."], "attention": True, "confidence": True, "beam_size": 1}
    assert shown["choices"] == ["1.1. A dog runs.", "1.2. A cat sleeps."]
    assert shown["translation"] == "EIN HUND RENNT. Eine Katze."
    assert shown["marked"] == ["HUND", "Katze."]
    assert shown["listed"].endswith("source words no target word used: sleeps."), shown
    assert (shown["first"], shown["second"]) == ("A dog runs.", "A cat sleeps.")

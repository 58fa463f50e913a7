"""The beam trace tells the search's story exactly: each step's live candidates are the next step's
beams, the finished candidates are the hypotheses returned, and the tree's bold path is the answer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_decode import BOS, EOS, batch, make_model, sources

from qkv.io import checkpoint
from qkv.inspect.beam_trace import BeamTrace, SearchSteps, draw_trace, prefix, trace_beam, trace_html, tree
from qkv.infer.search import DecodeConfig, beam_search


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_trace_is_the_search(seed):
    model, src = make_model(seed), batch(sources([6, 4], seed=seed))
    config = DecodeConfig(beam_size=3, n_best=3, max_len_b=8)
    steps: list[dict] = []
    hyps = beam_search(model, src, bos_id=BOS, eos_id=EOS, config=config, trace=steps)[0]  # sentence 0's
    assert hyps == beam_search(model, src, bos_id=BOS, eos_id=EOS, config=config)[0]  # tracing changes nothing
    assert steps[0]["beams"] == [{"tokens": [], "score": 0.0}]  # step 0 extends BOS alone
    for now, after in zip(steps, steps[1:]):
        live = [c for c in now["candidates"] if c["fate"] == "live"]
        expected = [{"tokens": now["beams"][c["beam"]]["tokens"] + [c["token"]], "score": c["score"]} for c in live]
        assert after["beams"] == expected and len(live) == 3
    finished = [
        (tuple(s["beams"][c["beam"]]["tokens"] + ([] if c["token"] == EOS else [c["token"]])), c["normalized"])
        for s in steps for c in s["candidates"] if c["fate"] == "finished"
    ]
    # a later, better hypothesis can push an earlier one out of the K kept: the K best are returned
    assert sorted(finished, key=lambda f: -f[1])[: len(hyps)] == [(tuple(h.tokens), pytest.approx(h.score)) for h in hyps]
    scores = [c["score"] for s in steps for c in s["candidates"]]
    assert all(a >= b for s in steps for a, b in zip([c["score"] for c in s["candidates"]], [c["score"] for c in s["candidates"]][1:]))
    assert len(scores) > 3 * len(steps) - 1  # 2K candidates a step, less the unused


def test_tree_picture_and_page(tmp_path):
    model, src = make_model(0), batch(sources([5], seed=7))
    config = DecodeConfig(beam_size=2, max_len_b=5)
    raw: list[dict] = []
    best = beam_search(model, src, bos_id=BOS, eos_id=EOS, config=config, trace=raw)[0][0].tokens
    steps = SearchSteps(lambda ids: [f"t{i}" for i in ids])
    assert beam_search(model, src, bos_id=BOS, eos_id=EOS, config=config, trace=steps)[0][0].tokens == best
    # Each beam is a back-pointer; following the pointers rebuilds the prefix the search held.
    for s, r in zip(steps, raw):
        assert [b["score"] for b in s["beams"]] == [b["score"] for b in r["beams"]]
        assert [prefix_of(steps, s["step"], j) for j in range(len(s["beams"]))] == [b["tokens"] for b in r["beams"]]
    trace = BeamTrace("src", "out", 2, config.length_penalty, list(steps), best)
    nodes, path = tree(trace)
    assert [prefix(nodes, node) for node in path[: len(best) + 1]] == [best[:i] for i in range(len(best) + 1)]
    assert all(nodes[node]["parent"] == path[i] for i, node in enumerate(path[1:]))  # a path in the tree
    assert nodes[path[-1]]["fate"] == "finished" and nodes[path[-1]]["normalized"] == max(
        n["normalized"] for n in nodes if n["fate"] == "finished")
    assert draw_trace(trace, tmp_path / "t.png").stat().st_size > 1000
    page = trace_html(trace)
    assert page.count("<tr>") == 1 + sum(len(s["candidates"]) for s in steps) and "<svg" in page
    assert page.count('<g id="n') == len(nodes) == 1 + sum(len(s["candidates"]) for s in steps)
    assert json.loads(trace.to_json())["best"] == best


def prefix_of(steps: list[dict], step: int, beam: int) -> list[int]:
    """The tokens of beam ``beam`` of step ``step``, from the back-pointers of the JSON."""
    tokens = []
    while step > 0:
        pointer = steps[step]["beams"][beam]
        tokens.append(pointer["token"])
        step, beam = step - 1, pointer["parent"]
    return tokens[::-1]


def test_a_trace_grows_linearly_with_its_steps(random_checkpoint):
    """A trace of 3x the steps is at most about 3x the JSON and the page: the beams are back-pointers,
    and a candidate's row links to its beam's node instead of spelling out the prefix."""
    loaded = checkpoint.load(random_checkpoint)
    model, tok = loaded.model, loaded.tokenizer
    never_eos = model.generator.register_forward_hook(  # every search runs to its limit: T steps
        lambda module, inputs, out: out.index_fill(-1, torch.tensor([tok.eos_id]), float("-inf")))
    try:
        sizes = {}
        for T in (40, 120):
            trace = trace_beam(model, tok, "A dog runs across the green field.", DecodeConfig(beam_size=4, max_len_a=0, max_len_b=T))
            assert len(trace.steps) == T and len(trace.best) == T
            sizes[T] = len(trace.to_json()), len(trace_html(trace))
    finally:
        never_eos.remove()
    (json_40, page_40), (json_120, page_120) = sizes[40], sizes[120]
    assert json_120 <= 3.3 * json_40, sizes
    assert page_120 <= 3.3 * page_40, sizes


def test_trace_through_the_command_line(tiny_run, tmp_path):
    src = tmp_path / "in.en"
    src.write_text("A dog runs in the park.\nTwo men.\n")
    qkv = [sys.executable, "-m", "qkv"]
    out = subprocess.run([*qkv, "attend", "--checkpoint", str(tiny_run), "A dog runs.", "--out", str(tmp_path / "a"),
                          "--trace", str(tmp_path / "t"), "--beam", "3"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert all((tmp_path / f"t.{ext}").stat().st_size > 0 for ext in ("png", "html", "json"))
    assert json.loads((tmp_path / "t.json").read_text())["source"] == "A dog runs."
    again = subprocess.run([*qkv, "translate", "--checkpoint", str(tiny_run), "-i", str(src), "--trace", str(tmp_path / "t")],
                           capture_output=True, text=True)
    assert again.returncode == 2 and "exists" in again.stderr and again.stdout == ""  # never overwritten without --force
    no_file = subprocess.run([*qkv, "translate", "--checkpoint", str(tiny_run), "--trace", str(tmp_path / "u")],
                             input="A dog.\n", capture_output=True, text=True)
    assert no_file.returncode == 2 and "--input" in no_file.stderr
    # --loop-guard 0: the trace draws the first search; the guard would search a looping line again
    ok = subprocess.run([*qkv, "translate", "--checkpoint", str(tiny_run), "-i", str(src), "--trace", str(tmp_path / "u"),
                         "--loop-guard", "0"], capture_output=True, text=True)
    assert ok.returncode == 0 and len(ok.stdout.splitlines()) == 2
    traced = json.loads((tmp_path / "u.json").read_text())
    assert traced["source"] == "A dog runs in the park."
    assert traced["translation"] == ok.stdout.splitlines()[0]  # the beam drawn is the search translate ran

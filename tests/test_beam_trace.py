"""The beam trace tells the search's story exactly: each step's live candidates are the next step's
beams, the finished candidates are the hypotheses returned, and the tree's bold path is the answer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_decode import BOS, EOS, batch, make_model, sources

from qkv.beam_trace import BeamTrace, draw_trace, trace_html, tree
from qkv.decode import DecodeConfig, beam_search


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
    steps: list[dict] = []
    best = beam_search(model, src, bos_id=BOS, eos_id=EOS, config=config, trace=steps)[0][0].tokens
    for s in steps:
        for c in s["candidates"]:
            c["piece"] = f"t{c['token']}"
    trace = BeamTrace("src", "out", 2, config.length_penalty, steps, best)
    nodes, path = tree(trace)
    assert path[: len(best) + 1] == [tuple(best[:i]) for i in range(len(best) + 1)]
    assert all(nodes[p]["parent"] == path[i] for i, p in enumerate(path[1:]))  # a path in the tree
    assert draw_trace(trace, tmp_path / "t.png").stat().st_size > 1000
    page = trace_html(trace)
    assert page.count("<tr>") == 1 + sum(len(s["candidates"]) for s in steps) and "<svg" in page
    assert json.loads(trace.to_json())["best"] == best


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
    ok = subprocess.run([*qkv, "translate", "--checkpoint", str(tiny_run), "-i", str(src), "--trace", str(tmp_path / "u")],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and len(ok.stdout.splitlines()) == 2
    traced = json.loads((tmp_path / "u.json").read_text())
    assert traced["source"] == "A dog runs in the park."
    assert traced["translation"] == ok.stdout.splitlines()[0]  # the beam drawn is the search translate ran

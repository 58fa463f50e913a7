"""The benchmark command: ``python -m benchmarks.run --smoke`` runs (c) translation and (d) scaling end
to end on a random model, and writes the tables in the shape the README describes. Structure only:
nothing here reads a timing, except that a median lies within its own min-max."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qkv.model.bf16 import bf16_native

ROOT = Path(__file__).resolve().parents[2]
ENGINES = {("qkv", "float32"), ("qkv", "int8"), ("huggingface", "float32"), ("ctranslate2", "float32"), ("ctranslate2", "int8")}
BF16 = {("qkv", "bfloat16")} if bf16_native(torch.device("cpu")) else set()  # qkv translate --bf16, where the CPU has it
# Elsewhere the bfloat16 cells are left out and the table says why.
MISSING = {} if BF16 else {"qkv bfloat16": "this CPU has no AVX-512 BF16 or AMX (qkv translate --bf16 would decode in float32)"}
OWN_ONLY = {("qkv", "float32+shortlist"), ("qkv", "int8+shortlist"), ("ctranslate2", "float32+vmap"), ("ctranslate2", "int8+vmap"),
            ("qkv+ct2", "float32"), ("qkv+ct2", "int8")}


@pytest.fixture
def benchmarks(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import probe, translation

    return probe, translation


def test_same_batches_sort_by_source_length_then_position(benchmarks):
    _, translation = benchmarks
    src_ids = [[5, 6, 7], [5], [5, 6], [6], [7, 7, 7]]
    assert translation.same_batches(src_ids, 2) == [[1, 3], [2, 0], [4]]


def test_check_load_warns_only_when_another_job_runs(benchmarks, monkeypatch):
    probe, _ = benchmarks
    messages = []
    monkeypatch.setattr(probe.os, "getloadavg", lambda: (2.4, 1.0, 1.0))
    assert probe.check_load("quiet", 2, messages.append) == 2.4 and messages == []  # this benchmark's own 2 threads
    monkeypatch.setattr(probe.os, "getloadavg", lambda: (3.9, 1.0, 1.0))
    assert probe.check_load("busy", 2, messages.append) == 3.9
    assert len(messages) == 1 and messages[0].startswith("WARNING: load average 3.9 before busy")


def test_smoke_run_writes_the_translation_and_scaling_tables(random_checkpoint, multi30k, tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "benchmarks.run", "--smoke", "--only", "c,d", "--threads", "1",
               "--checkpoint", str(random_checkpoint), "--data-dir", str(multi30k), "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    markdown = (out / "results.md").read_text()

    c = results["sections"]["translation"]
    assert c["missing"] == MISSING and c["repeats"] == 2 and c["sentences"] == 24
    assert c["same_batches"] == 3 and c["same_batch_sentences"] == 8  # 24 sentences in batches of 8
    cells = {(r["table"], r["engine"], r["compute"], r["beam"]) for r in c["rows"]}
    assert cells == {(t, e, p, b) for t in ("same", "own") for e, p in ENGINES | BF16 for b in (1, 5)} | \
        {("own", e, p, b) for e, p in OWN_ONLY for b in (1, 5)}
    assert c["shortlist"]["pairs"] == 29_000  # built on the Multi30k training pairs
    for r in c["rows"]:
        assert len(r["seconds"]) == 2 and r["sentences_per_s_min"] <= r["sentences_per_s"] <= r["sentences_per_s_max"]
        assert isinstance(r["load"], float) and isinstance(r["busy"], bool) and 0 <= r["bleu"] <= 100
        if (r["engine"], r["compute"]) == ("qkv", "float32"):
            assert r["identical_to_qkv"] == 1.0
        if r["engine"] in ("qkv", "ctranslate2") and r["table"] == "own":
            assert "tokens per batch" in r["settings"]
    chosen = {(x["engine"], x["beam"], x["compute"]) for x in c["own_choices"]}
    assert chosen == {(e, b, p) for e in ("qkv", "ctranslate2") for b in (1, 5) for p in ("float32", "int8")} | \
        {(e, b, p) for e, p in OWN_ONLY | BF16 for b in (1, 5) if e != "qkv+ct2"}  # --engine ctranslate2 has no choice
    targets = {t["target"]: t for t in c["targets"]}
    assert list(targets) == ["beam 5: qkv fp32 / CTranslate2 fp32", "beam 5: qkv int8 / CTranslate2 int8",
                             "beam 5: qkv fp32+shortlist / CTranslate2 int8+vmap", "beam 5: qkv int8+shortlist / CTranslate2 int8+vmap",
                             "greedy: qkv fp32 / CTranslate2 fp32",
                             "beam 5: qkv bf16 / CTranslate2 fp32", "beam 5: qkv bf16 / CTranslate2 int8",
                             "greedy: qkv bf16 / CTranslate2 fp32",
                             "beam 5: qkv --engine ctranslate2 / CTranslate2 fp32",
                             "beam 5: qkv --engine ctranslate2 --int8 / CTranslate2 int8",
                             "greedy: qkv --engine ctranslate2 / CTranslate2 fp32",
                             "beam 5: qkv fp32+compiled / CTranslate2 fp32", "beam 5: qkv fp32+compiled / CTranslate2 int8",
                             "greedy: qkv fp32+compiled / CTranslate2 fp32",
                             "beam 5: qkv fp32 / Hugging Face generate"]
    for name, t in targets.items():
        for table in ("same", "own"):
            cell = t[table]
            if "bf16" in name and not BF16:
                continue
            if "compiled" in name:  # the compiled cells run only when --engines names them
                assert cell == {"available": False, "reason": "an engine is missing"}
                continue
            if table == "same" and ("shortlist" in name or "--engine" in name):
                assert cell == {"available": False, "reason": "own settings only"}
                continue
            assert cell["available"] and cell["low"] <= cell["ratio"] <= cell["high"]
    for heading in ("**Same batches**", "**Own settings**", "**Targets**",
                    "| engine | compute | beam | sentences/s | min-max | ms/sentence | load | identical to qkv | BLEU |",
                    "| target | goal | same batches | own settings |"):
        assert heading in markdown

    d = results["sections"]["scaling"]["decode"]
    cached, full = d["with_cache"], d["without_cache"]
    assert d["repeats"] == 3 and cached["positions"] == list(range(1, 25)) and full["positions"] == [1, 8, 16, 24]
    for series in (cached, full):
        assert len(series["median_ms"]) == len(series["min_ms"]) == len(series["max_ms"]) == len(series["positions"])
        assert all(lo <= m <= hi for lo, m, hi in zip(series["min_ms"], series["median_ms"], series["max_ms"]))
    assert (out / d["plot"]).stat().st_size > 0
    assert "| position | with KV cache (ms) | without cache (ms) |" in markdown and "### (d) Scaling" in markdown


def test_smoke_run_of_training_speed_by_vocabulary_size(multi30k, tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "benchmarks.run", "--smoke", "--only", "b", "--training", "vocab", "--threads", "1",
               "--data-dir", str(multi30k), "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    section = json.loads((out / "results.json").read_text())["sections"]["training"]["vocab"]
    rows = section["rows"]
    assert [r["vocab_size"] for r in rows] == [300, 600] and section["pairs"] == 100 and section["repeats"] == 2
    # the same pairs: the smaller vocabulary cuts them into more pieces, and has fewer parameters
    assert rows[0]["target_tokens"] > rows[1]["target_tokens"] and rows[0]["parameters"] < rows[1]["parameters"]
    for r in rows:
        assert r["sentences_per_s_min"] <= r["sentences_per_s"] <= r["sentences_per_s_max"] and r["steps"] >= 1
    assert "| vocabulary | parameters | updates for the pairs |" in (out / "results.md").read_text()


def test_shape_cost_times_every_shape_on_the_same_batches(multi30k):
    from benchmarks.shape_cost import measure

    seconds = measure({"preset": {}, "ff512": {"d_ff": 512}}, data_dir=str(multi30k), bf16=False, batches=2, repeats=2,
                      smoke=True)
    assert list(seconds) == ["preset", "ff512"]
    assert all(len(s) == 2 and all(x > 0 for x in s) for s in seconds.values())


def test_stream_lines_times_every_setting_on_the_same_lines(random_checkpoint, multi30k, tmp_path):
    out = tmp_path / "stream.json"
    command = [sys.executable, "-m", "benchmarks.stream_lines", "--checkpoint", str(random_checkpoint), "--data-dir",
               str(multi30k), "--workers", "1", "--threads", "1", "--repeats", "2", "--first", "60", "--settings", "256x2048x128,32x512x16",
               "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["lines"], r["max_tokens"], r["max_sentences"]) for r in rows] == [(256, 2048, 128), (32, 512, 16)]
    for r in rows:  # val's first 60 lines; the batching never changes a translation
        assert r["sentences"] == 60 and r["same_as_first"] == 60
        assert r["sentences_per_s_min"] <= r["sentences_per_s"] <= r["sentences_per_s_max"]
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr  # never overwrites a result


def test_training_attention_times_both_paths_on_the_same_numbers(monkeypatch):
    """benchmarks.training_attention: both paths agree (outputs and q, k, v gradients), each median lies
    in its own range, and the rows say which side of SHORT_TRAINING_ATTENTION each length falls."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.training_attention import measure

    short, long = measure(16, tokens=160, repeats=2), measure(80, tokens=160, repeats=2)
    assert (short["batch"], short["explicit_in_training"], long["explicit_in_training"]) == (10, True, False)
    for row in (short, long):
        assert row["max_difference"] < 1e-4
        assert row["fused_ms_range"][0] <= row["fused_ms"] <= row["fused_ms_range"][1]
        assert row["explicit_ms_range"][0] <= row["explicit_ms"] <= row["explicit_ms_range"][1]

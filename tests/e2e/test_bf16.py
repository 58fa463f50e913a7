"""bfloat16 decoding (`--bf16`, qkv.model.bf16): where the hardware multiplies bfloat16 natively the
model decodes in bfloat16 with its scores in float32; elsewhere a one-line note and float32."""

from __future__ import annotations

import pytest
import torch
from test_decode import BOS, EOS, batch, make_model, sources

import qkv.model.bf16
from qkv.cli.main import main
from qkv.infer.search import DecodeConfig, search
from qkv.model.bf16 import bf16_native, decoding_dtype

CPU = torch.device("cpu")
native = pytest.mark.skipif(not bf16_native(CPU), reason="this CPU has no AVX-512 BF16 or AMX: --bf16 decodes in float32")


def test_bf16_is_chosen_only_where_native_and_a_refusal_says_why(monkeypatch):
    monkeypatch.setattr(qkv.model.bf16, "cpu_has_bf16", lambda: True)
    assert decoding_dtype(CPU, True) == (torch.bfloat16, None)
    assert decoding_dtype(CPU, False) == (torch.float32, None)
    monkeypatch.setattr(qkv.model.bf16, "cpu_has_bf16", lambda: False)
    dtype, note = decoding_dtype(CPU, True)
    assert dtype == torch.float32 and "AVX-512 BF16" in note and "float32" in note and "\n" not in note
    assert decoding_dtype(CPU, None) == (torch.float32, None)  # nothing asked, nothing to say


@native
def test_bf16_search_scores_in_float32_and_keeps_the_fp32_translations_of_a_model():
    """The logits are bfloat16, the scores accumulate in float32: the best hypotheses' scores stay
    within bfloat16's rounding of float32's, and the search returns what float32's does, mostly."""
    model = make_model(0)
    half = make_model(0).to(torch.bfloat16)
    src = batch(sources([6, 9, 4, 7, 5, 8], seed=3))
    config = DecodeConfig(beam_size=3, max_len_b=6)
    exact = search(model, src, bos_id=BOS, eos_id=EOS, config=config)
    approx = search(half, src, bos_id=BOS, eos_id=EOS, config=config)
    assert all(isinstance(h[0].score, float) for h in approx)
    same = sum(a[0].tokens == e[0].tokens for a, e in zip(approx, exact))
    assert same >= 4, (same, [a[0].tokens for a in approx], [e[0].tokens for e in exact])
    for a, e in zip(approx, exact):
        if a[0].tokens == e[0].tokens:
            assert abs(a[0].score - e[0].score) < 0.05 * max(1.0, abs(e[0].score)), (a[0].score, e[0].score)


@native
def test_translate_evaluate_and_score_with_bf16_through_the_command_line(random_checkpoint, tmp_path, capsys):
    """--bf16 translates every line, evaluate says it decoded in bfloat16, and its
    chrF against the float32 translations is high (an approximation, not a different model)."""
    import sacrebleu

    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    lines = ["A man is riding a bike.", "Two dogs play in the snow.", "", "A woman sings on a stage.",
             "Children are playing football in a park.", "A man in a red shirt is cooking."]
    src.write_text("\n".join(lines) + "\n")
    ref.write_text("\n".join(["Ein Mann fährt Fahrrad."] * len(lines)) + "\n")
    def run(*args: str) -> str:
        assert main(list(args)) == 0
        return capsys.readouterr().out

    fp32 = run("translate", "--checkpoint", str(random_checkpoint), "-i", str(src)).split("\n")
    bf16 = run("translate", "--checkpoint", str(random_checkpoint), "--bf16", "-i", str(src)).split("\n")
    assert len(bf16) == len(fp32) == len(lines) + 1 and bf16[2] == ""
    assert sum(a == b for a, b in zip(bf16, fp32)) > len(fp32) / 2 and sacrebleu.corpus_chrf(bf16, [fp32]).score > 80, (bf16, fp32)
    out = run("evaluate", "--checkpoint", str(random_checkpoint), "--bf16", "--src-file", str(src), "--ref-file", str(ref))
    assert "bfloat16" in out and "BLEU" in out
    scored = run("score", "--checkpoint", str(random_checkpoint), "--bf16", "-i", str(src), "-r", str(ref)).split("\n")
    exact = run("score", "--checkpoint", str(random_checkpoint), "-i", str(src), "-r", str(ref)).split("\n")
    assert len(scored) == len(exact) and scored != exact  # computed in bfloat16: close, not the same digits
    first = lambda line: float(line.split("\t")[0])  # noqa: E731
    assert abs(first(scored[0]) - first(exact[0])) < 0.05 * abs(first(exact[0])) + 0.05
    assert main(["translate", "--checkpoint", str(random_checkpoint), "--bf16", "--int8", "-i", str(src)]) == 2
    assert "choose one" in capsys.readouterr().err


@native
@pytest.mark.parametrize("batching", ["batches", "continuous"])
def test_the_server_searches_in_bf16_and_judges_with_the_float32_model(random_checkpoint, batching):
    """create_app(dtype=bfloat16): the translations are a bfloat16 Translator's; the confidence is read
    from the float32 model, as `qkv score --confidence` reads it."""
    import asyncio

    import httpx

    from qkv.infer.translator import Translator
    from qkv.inspect.trust import assess, calibration_of
    from qkv.io import checkpoint
    from qkv.serve.app import create_app

    texts = ["A dog runs.", "Two children play with a red ball."]
    app = create_app(random_checkpoint, dtype=torch.bfloat16, batching=batching)

    async def ask():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=60) as client:
                body = (await client.post("/v1/translate", json={"texts": texts, "confidence": True})).json()
                return body, (await client.get("/v1/stats")).json()

    body, stats = asyncio.run(ask())
    assert stats["continuous_requests"] == (batching == "continuous") and stats["batches"] == (batching == "batches"), stats
    loaded = checkpoint.load(random_checkpoint)
    defaults = checkpoint.decode_defaults(loaded.config)
    half = Translator(checkpoint.load(random_checkpoint).model.to(torch.bfloat16), loaded.tokenizer, DecodeConfig(**defaults))
    assert body["translations"] == half.translate(texts)
    trusts = assess(loaded.model, loaded.tokenizer, texts, body["translations"], calibration=calibration_of(loaded.path))
    assert [c["confidence"] for c in body["confidence"]] == pytest.approx([t.confidence for t in trusts], abs=1e-4)

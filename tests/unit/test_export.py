"""Export to CTranslate2: the exported model translates exactly as qkv does, greedy and beam."""

from pathlib import Path

import pytest
import torch

ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (one of qkv's requirements: pip install -e .)")

from qkv.io import checkpoint
from qkv.cli import main as cli  # noqa: E402
from qkv.model.config import ModelConfig  # noqa: E402
from qkv.infer.search import DecodeConfig  # noqa: E402
from qkv.interop.ctranslate2 import ct2_translate_ids, ctranslate2_spec, export_ctranslate2  # noqa: E402
from qkv.model.transformer import Transformer  # noqa: E402
from qkv.data.tasks import date_pairs  # noqa: E402
from qkv.data.tokenizer import Tokenizer  # noqa: E402
from qkv.infer.translator import Translator  # noqa: E402

PAIRS = date_pairs(400, seed=3)
SOURCES = [s for s, _ in PAIRS[-16:]]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    texts = [s for s, _ in PAIRS] + [t for _, t in PAIRS]
    return Tokenizer.train(texts, 120, tmp_path_factory.mktemp("tok") / "tokenizer.model")


def random_model(tokenizer: Tokenizer, seed: int = 0, **overrides) -> Transformer:
    """A tiny model with weights large enough for peaked, varied outputs, and an EOS bias so that
    hypotheses end at different lengths (some at EOS, some at the length limit)."""
    torch.manual_seed(seed)
    config = ModelConfig(
        src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, d_model=32, n_heads=4, d_ff=64,
        n_encoder_layers=2, n_decoder_layers=2, dropout=0.0, max_len=64, pad_id=tokenizer.pad_id, output_bias=True,
        **overrides,
    )
    model = Transformer(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(3.0)
        model.generator.bias[tokenizer.eos_id] = 3.0
    return model


def export(model: Transformer, tokenizer: Tokenizer, directory: Path):
    directory.mkdir(parents=True)
    ctranslate2_spec(model, tokenizer).save(str(directory))
    return ctranslate2.Translator(str(directory), device="cpu", intra_threads=1)


def both(model, tokenizer, engine, beam: int) -> tuple[list[list[int]], list[list[int]]]:
    config = DecodeConfig(beam_size=beam, stop_early=True)  # CTranslate2's stopping rule
    translator = Translator(model, tokenizer, config)
    ids = [translator.encode(s) for s in SOURCES]
    ours = [h[0].tokens for h in translator.translate_ids(ids)]
    theirs = ct2_translate_ids(engine, tokenizer, ids, config, max_len=model.config.max_len)
    return ours, theirs


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # the paper: post-LN, ReLU, interleaved positions
        dict(norm_first=True, activation="gelu", position_layout="split"),
        dict(norm_first=True, activation="silu", scale_embeddings=False, share_embeddings=False, tie_output=False),
    ],
    ids=["post-ln", "pre-ln-gelu-split", "pre-ln-silu-untied"],
)
def test_ctranslate2_translates_like_qkv(tokenizer, tmp_path, overrides):
    model = random_model(tokenizer, **overrides)
    engine = export(model, tokenizer, tmp_path / "ct2")
    for beam in (1, 5):
        ours, theirs = both(model, tokenizer, engine, beam)
        assert ours == theirs, f"beam {beam}"
    # The comparison means something only if the outputs vary in length and content.
    assert len({len(t) for t in ours}) > 3 and len({tuple(t) for t in ours}) > 3


def test_a_changed_weight_changes_the_translations(tokenizer, tmp_path):
    """The parity above is not vacuous: export, then perturb one qkv weight, and outputs differ."""
    model = random_model(tokenizer)
    engine = export(model, tokenizer, tmp_path / "ct2")
    with torch.no_grad():
        model.decoder_layers[1].cross_attn.in_proj.weight[40:].mul_(-1.0)  # the keys and values of one layer
    ours, theirs = both(model, tokenizer, engine, 1)
    assert ours != theirs


def test_export_command_writes_a_model_and_checks_parity(tokenizer, tmp_path, capsys):
    model = random_model(tokenizer, norm_first=True)
    ckpt = checkpoint.save(tmp_path / "ckpt", model, tokenizer)
    sources = tmp_path / "sources.txt"
    sources.write_text("\n".join(SOURCES[:6]) + "\n", encoding="utf-8")
    out = tmp_path / "ct2"
    code = cli.main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--check", "6", "--check-file", str(sources)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert {"model.bin", "shared_vocabulary.json", "config.json", "tokenizer.model"} <= {p.name for p in out.iterdir()}
    assert "beam 1: 6/6 identical" in printed and "beam 5: 6/6 identical" in printed
    # A second export into the same directory needs --force.
    assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--check", "0"]) == 2
    assert export_ctranslate2(ckpt, out, force=True) == out

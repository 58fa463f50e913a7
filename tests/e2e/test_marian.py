"""`qkv import marian` and `qkv export --format marian`: Hugging Face Marian (OPUS-MT) directories as qkv checkpoints.

Offline: the Marian directory is built here, as `save_pretrained` writes it for a `MarianMTModel` with
random weights and a `MarianTokenizer` whose two SentencePiece models are trained on a few hundred
Multi30k lines (English source, German target) with a vocab.json joining their pieces.
"""

from __future__ import annotations

import asyncio
import gzip
import importlib.util
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

from conftest import require_multi30k, snapshot  # noqa: E402

from qkv.model import attention
from qkv.io import checkpoint
from qkv.cli import main as cli
from qkv.model import kernels  # noqa: E402
from qkv.infer.search import DecodeConfig  # noqa: E402
from qkv.data.marian_tokenizer import MarianTokenizer  # noqa: E402
from qkv.infer.translator import Translator  # noqa: E402

MAX_NEW = 20  # output tokens at most, EOS included: qkv --max-len-a 0 --max-len-b 20, generate(max_new_tokens=20)
BEAM = dict(num_beams=4, length_penalty=0.0, early_stopping=True)  # where the searches coincide (see the beam test)
# Inputs beyond Multi30k: empty and blank lines, characters neither SentencePiece model has seen, the
# special tokens' text inside a sentence, a language code, odd whitespace and compatibility characters.
ODD_LINES = [
    "", " ", "\t", "  two   spaces  ", "Snow ☃ and 漢字 and 🙂.", "a </s> b", "x<pad>y<unk>z", "</s>", ">>de<< A dog runs.",
    ">>xx<<", "a >>de<< b", "A dog\u00a0runs", "ﬁne Ⅻ ligatures", "<s> start", "Émile's café, naïve", "¿Qué? ¡Sí!",
]


def qkv(*args: str | Path, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv", *map(str, args)], input=input, capture_output=True, text=True, timeout=300)


def in_process(capsys, *args: str | Path) -> SimpleNamespace:
    """`qkv ARGS` run by ``qkv.cli.main.main`` in this process (no interpreter start-up), as ``qkv`` returns it."""
    capsys.readouterr()
    code = cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)


def refused(result: subprocess.CompletedProcess | SimpleNamespace, command: str, message: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qkv {command}: error: ") and message in lines[0], result.stderr


def multi30k_lines(split: str, lang: str, n: int, start: int = 0) -> list[str]:
    with gzip.open(require_multi30k() / f"{split}.{lang}.gz", "rt", encoding="utf-8") as handle:
        return handle.read().splitlines()[start : start + n]


def check_sources() -> list[str]:
    """The sentences that greedy and beam outputs are compared on."""
    return multi30k_lines("val", "en", 40)


def hf_generate(model, hf_tok, sources: list[str], **search) -> list[list[int]]:
    """transformers' outputs, one sentence at a time: the ids after the decoder start, up to the first EOS.
    Greedy unless ``search`` says otherwise (not the model's default num_beams)."""
    outputs = []
    search = {"num_beams": 1, **search}
    for source in sources:
        ids = model.generate(**hf_tok(source, return_tensors="pt"), max_new_tokens=MAX_NEW, do_sample=False, **search)[0].tolist()[1:]
        outputs.append(ids[: ids.index(hf_tok.eos_token_id)] if hf_tok.eos_token_id in ids else ids)
    return outputs


def varied(outputs: list[list[int]]) -> bool:
    """At least a quarter of the outputs differ, and at least 5 end at EOS while 5 others reach the length
    limit: without that a comparison of two searches would mean little."""
    lengths = [len(o) for o in outputs]
    return len(set(map(tuple, outputs))) >= len(outputs) // 4 and sum(n < MAX_NEW for n in lengths) >= 5 and lengths.count(MAX_NEW) >= 5


def train_spm(texts: list[str], path: Path) -> list[str]:
    """A unigram SentencePiece model (OPUS-MT's kind) written to ``path``; returns its pieces in id order."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=300, model_type="unigram",
        character_coverage=0.98, hard_vocab_limit=False, minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


def build_marian_dir(directory: Path) -> Path:
    """A Marian directory as `save_pretrained` writes it (config.json, model.safetensors, generation_config.json,
    source.spm, target.spm, vocab.json, tokenizer_config.json).

    vocab.json is laid out as OPUS-MT's: </s> 0, <unk> 1, the pieces of both models, <pad> last (and one
    language code, as a multilingual model's). Every seventh target piece is left out of it, so that
    pieces the SentencePiece model knows but the vocabulary does not become <unk>, as in transformers.
    The weights are random but large (peaked attention, varied outputs), with a bias towards EOS so
    that outputs end at different lengths.
    """
    directory.mkdir(parents=True)
    source_pieces = train_spm(multi30k_lines("train", "en", 400), directory / "source.spm")
    target_pieces = train_spm(multi30k_lines("train", "de", 400), directory / "target.spm")
    vocab = {"</s>": 0, "<unk>": 1}
    dropped = set(target_pieces[10::7])
    for piece in source_pieces + [p for p in target_pieces if p not in dropped]:
        if piece not in vocab and piece not in ("<s>",):
            vocab[piece] = len(vocab)
    vocab[">>de<<"] = len(vocab)  # a language code, as multilingual models have (>>xx<< is not one)
    vocab["<pad>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer = transformers.MarianTokenizer(
        str(directory / "source.spm"), str(directory / "target.spm"), str(directory / "vocab.json"), source_lang="en", target_lang="de"
    )
    config = transformers.MarianConfig(
        vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        activation_function="swish", scale_embedding=True, max_position_embeddings=128, pad_token_id=vocab["<pad>"],
        eos_token_id=0, decoder_start_token_id=vocab["<pad>"], forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif "embed_positions" not in name:
                param.normal_(0, 0.5 if param.dim() > 1 else 0.1)
        # EOS's logit gets a constant bias: the smallest of these for which outputs end at different lengths
        # (some at EOS, some at the length limit) in both searches, whatever the random draw above.
        for bias in range(2, 20):
            model.final_logits_bias[0, 0] = float(bias)
            if all(varied(hf_generate(model, tokenizer, check_sources(), **search)) for search in ({}, BEAM)):
                break
        else:
            raise AssertionError("no EOS bias gives varied outputs; change the seed")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    generation = json.loads((directory / "generation_config.json").read_text())  # search settings, as OPUS-MT's have
    (directory / "generation_config.json").write_text(json.dumps({**generation, "num_beams": 4, "max_length": 64}))
    return directory


@pytest.fixture(scope="session")
def marian_dir(tmp_path_factory) -> Path:
    return build_marian_dir(tmp_path_factory.mktemp("marian") / "opus-mt-en-de")


@pytest.fixture(scope="session")
def hf(marian_dir):
    """The Marian model and tokenizer as transformers loads them from the directory."""
    model = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
    return model, transformers.MarianTokenizer.from_pretrained(marian_dir)


@pytest.fixture(scope="session")
def imported(marian_dir) -> Path:
    """The directory imported through the command line."""
    out = marian_dir.parent / "imported"
    result = qkv("import", "marian", marian_dir, "--out", out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="session")
def sources() -> list[str]:
    return check_sources()


def qkv_tokens(checkpoint_dir: Path, sources: list[str], config: DecodeConfig) -> list[list[int]]:
    translator = Translator.from_checkpoint(checkpoint_dir, config)
    return [h[0].tokens for h in translator.translate_ids([translator.encode(s) for s in sources])]


def test_token_ids_are_the_marian_tokenizers(imported, hf):
    """The tokenizer qkv loads from the imported checkpoint gives transformers' ids, for sources (source.spm)
    and targets (target.spm), on 300 Multi30k lines of each language and on odd lines; decoding gives
    transformers' text (skip_special_tokens=True)."""
    model, hf_tok = hf
    tok = checkpoint.load(imported).tokenizer
    assert isinstance(tok, MarianTokenizer)
    assert (tok.pad_id, tok.eos_id, tok.unk_id, tok.vocab_size) == (hf_tok.pad_token_id, hf_tok.eos_token_id, hf_tok.unk_token_id, len(hf_tok))
    assert tok.bos_id == model.config.decoder_start_token_id == tok.pad_id  # Marian starts decoding from pad
    sources = multi30k_lines("val", "en", 150) + multi30k_lines("test_2016_flickr", "en", 150) + ODD_LINES
    targets = multi30k_lines("val", "de", 150) + multi30k_lines("test_2016_flickr", "de", 150) + ODD_LINES
    ours = [tok.encode(s) + [tok.eos_id] for s in sources]
    assert ours == [hf_tok(s)["input_ids"] for s in sources]
    assert tok.encode_batch(sources) == [ids[:-1] for ids in ours]
    ours_target = [tok.encode_target(t) + [tok.eos_id] for t in targets]
    assert ours_target == [hf_tok(text_target=t)["input_ids"] for t in targets]
    assert ours_target != [tok.encode(t) + [tok.eos_id] for t in targets]  # the target side has a model of its own
    # The test means something: unknown pieces, the special tokens' text and a language code all occur.
    assert sum(ids.count(tok.unk_id) for ids in ours_target) > 10
    assert tok.encode("a </s> b")[1] == tok.eos_id and tok.encode(">>de<< A dog.")[0] == tok.vocab[">>de<<"]
    # A search never returns an EOS inside its output (qkv cuts there); other ids decode as transformers does.
    ids = [i[:-1] for i in ours_target if tok.eos_id not in i[:-1]]
    assert [tok.decode(i) for i in ids] == [hf_tok.decode(i, skip_special_tokens=True) for i in ids]


def test_greedy_outputs_are_token_identical(imported, hf, sources, tmp_path):
    model, hf_tok = hf
    theirs = hf_generate(model, hf_tok, sources)
    assert varied(theirs), theirs
    assert qkv_tokens(imported, sources, DecodeConfig(beam_size=1, max_len_a=0, max_len_b=MAX_NEW)) == theirs
    # and the command line writes what transformers decodes
    (tmp_path / "in.en").write_text("\n".join(sources) + "\n", encoding="utf-8")
    result = qkv("translate", "--checkpoint", imported, "--beam", "1", "--max-len-a", "0", "--max-len-b", MAX_NEW, "--loop-guard", "0",
                 "-i", tmp_path / "in.en")  # the exact search, as transformers'
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [hf_tok.decode(ids, skip_special_tokens=True) for ids in theirs]


def test_beam_outputs_are_token_identical_where_the_search_rules_coincide(imported, hf, sources):
    """Beam 4 with no length normalisation on either side and early stopping: there the two searches are one.

    transformers ranks a finished hypothesis by log-probability / length ** length_penalty, qkv by
    log-probability / ((5 + length) / 6) ** alpha (GNMT); with length_penalty=0.0 and alpha 0 both rank by
    the log-probability itself. With early_stopping=True transformers ends a sentence once num_beams
    hypotheses have finished, as qkv does with stop_early. Both take the 2 x num_beams best extensions at each step, finish
    those among the best num_beams that end in EOS, continue the best num_beams that do not, and finish the
    best num_beams at the length limit (20 tokens, EOS included, on both sides). The model's config has no
    forced EOS at the limit, a rule qkv does not have. With other settings (qkv's default alpha 0.6, or
    transformers' default early_stopping=False) the searches differ by design, and so may the outputs.
    """
    model, hf_tok = hf
    theirs = hf_generate(model, hf_tok, sources, **BEAM)
    assert varied(theirs), theirs
    config = DecodeConfig(beam_size=4, length_penalty=0.0, max_len_a=0, max_len_b=MAX_NEW, stop_early=True)
    assert qkv_tokens(imported, sources, config) == theirs


def logits(model, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=src, decoder_input_ids=tgt).logits


@pytest.mark.parametrize("same_kernels, atol", [(True, 1e-5), (False, 5e-4)])
def test_imported_model_gives_marians_logits(imported, hf, sources, same_kernels, atol, monkeypatch):
    """With the kernels Hugging Face runs (BLAS linear layers, PyTorch's fused attention) the logits
    agree to 1e-5; with qkv's inference kernels (oneDNN's linear layers, the explicit attention steps
    on short inputs: the same sums in other orders, ``qkv.model.kernels``, ``qkv.model.attention``) to 5e-4."""
    if same_kernels:
        monkeypatch.setattr(attention, "SHORT_ATTENTION", 0)
        monkeypatch.setattr(kernels, "_prefer_onednn", False)
    model, hf_tok = hf
    tok = checkpoint.load(imported)
    for source, target in zip(sources[:8], multi30k_lines("val", "de", 8)):
        src = torch.tensor([hf_tok(source)["input_ids"]])
        tgt = torch.tensor([[tok.tokenizer.bos_id, *hf_tok(text_target=target)["input_ids"]]])
        with torch.no_grad():
            torch.testing.assert_close(tok.model(src, tgt), logits(model, src, tgt), atol=atol, rtol=0)


def test_export_round_trip_gives_the_same_logits_and_ids(imported, hf, sources, tmp_path):
    """qkv -> `export --format marian` -> from_pretrained: the same logits (1e-5 absolute, float32) and the
    same tokenizer; the original generation settings come back with it."""
    out = tmp_path / "marian"
    check = tmp_path / "check.en"
    check.write_text("\n".join(sources) + "\n", encoding="utf-8")
    result = qkv("export", "--format", "marian", "--checkpoint", imported, "--out", out, "--check-file", check)
    assert result.returncode == 0, result.stderr
    assert f"gives qkv's ids on {len(sources)}/{len(sources)} sentences" in result.stdout, result.stdout
    noise = [line for line in result.stderr.splitlines() if "torchao" in line or "register_constant" in line]
    assert not noise, noise  # transformers imports torchao: its import-time notices are kept quiet
    exported = transformers.MarianMTModel.from_pretrained(out).eval()
    exported_tok = transformers.MarianTokenizer.from_pretrained(out)
    model, hf_tok = hf
    for source in sources[:8]:
        src = torch.tensor([hf_tok(source)["input_ids"]])
        assert exported_tok(source)["input_ids"] == src[0].tolist()
        tgt = torch.tensor([[hf_tok.pad_token_id, *hf_tok(text_target=source)["input_ids"]]])
        torch.testing.assert_close(logits(exported, src, tgt), logits(model, src, tgt), atol=1e-5, rtol=0)
    assert exported.generation_config.num_beams == 4 and exported.generation_config.max_length == 64
    assert (out / "qkv_config.json").exists()


def test_generation_settings_and_the_export_check(marian_dir, tmp_path, capsys, monkeypatch):
    """The original bad_words_ids (OPUS-MT forbids generating <pad>) travel through the checkpoint into the
    export; and the export's check fails the command (status 1) when ids or logits differ."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(marian_dir, hf_dir)
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    (hf_dir / "generation_config.json").write_text(json.dumps({**generation, "bad_words_ids": [[generation["pad_token_id"]]]}))
    assert in_process(capsys, "import", "marian", hf_dir, "--out", tmp_path / "ckpt").returncode == 0
    assert checkpoint.read_config(tmp_path / "ckpt")["marian"]["generation"]["bad_words_ids"] == [[generation["pad_token_id"]]]
    assert in_process(capsys, "export", "--format", "marian", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "out", "--check", "0").returncode == 0
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").bad_words_ids == [[generation["pad_token_id"]]]
    import qkv.interop.marian

    monkeypatch.setattr(qkv.interop.marian, "check_export", lambda *args: (5, 4, 0.0))
    sentences = tmp_path / "check.txt"
    sentences.write_text("A dog.\n", encoding="utf-8")
    result = in_process(capsys, "export", "--format", "marian", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "out",
                        "--force", "--check-file", sentences)  # fmt: skip
    assert result.returncode == 1 and "does not reproduce" in result.stderr


def test_a_pytorch_model_bin_imports_to_the_same_model(marian_dir, imported, tmp_path):
    """Weights as pytorch_model.bin (no model.safetensors) load through torch.load(weights_only=True); like
    older files it also holds the positional tables, which must be (and are) the sinusoids."""
    hf_dir = tmp_path / "bin"
    shutil.copytree(marian_dir, hf_dir)
    model = transformers.MarianMTModel.from_pretrained(hf_dir)
    (hf_dir / "model.safetensors").unlink()
    assert "model.encoder.embed_positions.weight" in model.state_dict()
    torch.save(model.state_dict(), hf_dir / "pytorch_model.bin")
    result = qkv("import", "marian", hf_dir, "--out", tmp_path / "ckpt")
    assert result.returncode == 0, result.stderr
    ours, reference = checkpoint.load(tmp_path / "ckpt"), checkpoint.load(imported)
    assert ours.model.state_dict().keys() == reference.model.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(ours.model.state_dict().values(), reference.model.state_dict().values()))
    assert ours.tokenizer.to_bytes() == reference.tokenizer.to_bytes()


class _Planted:
    """A pickle that, when unpickled, writes a file: the proof that it ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "the pickle ran"))


def test_a_planted_pickle_is_refused_without_running(marian_dir, tmp_path):
    hf_dir = tmp_path / "planted"
    shutil.copytree(marian_dir, hf_dir)
    (hf_dir / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({"model.shared.weight": torch.zeros(2), "payload": _Planted(marker)}, hf_dir / "pytorch_model.bin")
    result = qkv("import", "marian", hf_dir, "--out", tmp_path / "ckpt")
    refused(result, "import", "holds more than tensors")
    assert not marker.exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "case", ["no config", "bart", "no tokenizer", "no weights", "sharded", "separate vocabularies", "not a directory",
             "learned positions", "other pad id", "other vocabulary size", "added tokens"],
)
def test_a_directory_that_is_not_a_marian_model_is_refused(marian_dir, tmp_path, capsys, case):
    hf_dir = tmp_path / "hf"
    shutil.copytree(marian_dir, hf_dir)
    if case == "no config":
        (hf_dir / "config.json").unlink()
        message = "it has no config.json"
    elif case == "bart":
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "bart"}))
        message = "is not a Marian model: its config.json says model_type 'bart'"
    elif case == "no tokenizer":
        (hf_dir / "target.spm").unlink()
        message = "has no target.spm"
    elif case in ("no weights", "sharded"):
        (hf_dir / "model.safetensors").unlink()
        if case == "sharded":
            (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
        message = "has no model.safetensors or pytorch_model.bin" + (" (sharded weights are not supported)" if case == "sharded" else "")
    elif case in ("other pad id", "other vocabulary size"):
        config = json.loads((hf_dir / "config.json").read_text())
        key, value = ("pad_token_id", 1) if case == "other pad id" else ("vocab_size", config["vocab_size"] + 1)
        (hf_dir / "config.json").write_text(json.dumps({**config, key: value}))
        message = f"config.json has {key} {value}, the tokenizer files make it"
    elif case == "separate vocabularies":
        shutil.copyfile(hf_dir / "vocab.json", hf_dir / "target_vocab.json")
        message = "separate source and target vocabularies"
    elif case == "added tokens":
        settings = json.loads((hf_dir / "tokenizer_config.json").read_text())
        (hf_dir / "tokenizer_config.json").write_text(json.dumps({**settings, "additional_special_tokens": ["<eop>"]}))
        message = "adds tokens qkv's Marian tokenizer does not have (<eop>)"
    elif case == "learned positions":
        from safetensors.torch import load_file, save_file

        weights = load_file(hf_dir / "model.safetensors")
        weights["model.encoder.embed_positions.weight"] = torch.randn(128, 32)
        save_file(weights, hf_dir / "model.safetensors")
        message = "model.encoder.embed_positions.weight is not Marian's sinusoidal table"
    else:
        hf_dir = hf_dir / "vocab.json"
        message = "is not a directory"
    refused(in_process(capsys, "import", "marian", hf_dir, "--out", tmp_path / "ckpt"), "import", message)
    assert not (tmp_path / "ckpt").exists()



def test_import_and_export_never_write_over_a_users_files(marian_dir, imported, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    for force in ((), ("--force",)):
        refused(in_process(capsys, "import", "marian", marian_dir, "--out", mine, *force), "import", "exists; pass --force" if not force else "is not a qkv checkpoint")
        refused(in_process(capsys, "export", "--format", "marian", "--checkpoint", imported, "--out", mine, "--check", "0", *force), "export", "not an earlier qkv export")
        refused(in_process(capsys, "export", "--format", "marian", "--checkpoint", imported, "--out", imported, "--check", "0", *force), "export", "which this command reads")
    assert snapshot(mine) == {"notes.txt": b"my notes"}
    checkpoint.verify(imported)
    # --force replaces a qkv checkpoint (import) and an earlier export (export), nothing else
    ckpt = tmp_path / "ckpt"
    assert in_process(capsys, "import", "marian", marian_dir, "--out", ckpt).returncode == 0
    assert in_process(capsys, "import", "marian", marian_dir, "--out", ckpt, "--force").returncode == 0
    checkpoint.verify(ckpt)
    out = tmp_path / "export"
    assert in_process(capsys, "export", "--format", "marian", "--checkpoint", ckpt, "--out", out, "--check", "0").returncode == 0
    refused(in_process(capsys, "export", "--format", "marian", "--checkpoint", ckpt, "--out", out, "--check", "0"), "export", "pass --force to replace it")
    assert in_process(capsys, "export", "--format", "marian", "--checkpoint", ckpt, "--out", out, "--check", "0", "--force").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "export", "mine"]  # nothing left aside


def test_every_command_works_on_an_imported_model(imported, sources, tmp_path, capsys):
    """translate (above), evaluate, score, align, attend, doctor, serve and the CTranslate2 export, through
    the command line (in this process) on the imported checkpoint."""
    src, ref = tmp_path / "src.en", tmp_path / "ref.de"
    src.write_text("\n".join(sources[:12]) + "\n", encoding="utf-8")
    ref.write_text("\n".join(multi30k_lines("val", "de", 12)) + "\n", encoding="utf-8")
    result = in_process(capsys, "evaluate", "--checkpoint", imported, "--src-file", src, "--ref-file", ref, "--beam", "1")
    assert result.returncode == 0 and "BLEU" in result.stdout, result.stderr
    result = in_process(capsys, "score", "--checkpoint", imported, "-i", src, "-r", ref)
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 12, result.stderr
    result = in_process(capsys, "align", "--checkpoint", imported, "-i", src, "-r", ref)
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 12, result.stderr
    result = in_process(capsys, "attend", "--checkpoint", imported, "--beam", "1", sources[0], "--out", tmp_path / "att")
    assert result.returncode == 0 and (tmp_path / "att.png").exists() and (tmp_path / "att.html").exists(), result.stderr
    loaded = checkpoint.load(imported)
    expected = Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=1)).translate([sources[0]])[0]
    assert f"translation: {expected}" in result.stdout
    result = in_process(capsys, "doctor", "--checkpoint", imported)
    assert result.returncode == 0, result.stdout
    if importlib.util.find_spec("ctranslate2"):
        result = in_process(capsys, "export", "--checkpoint", imported, "--out", tmp_path / "ct2", "--check", "12", "--check-file", src)
        assert result.returncode == 0 and "12/12 identical" in result.stdout, result.stdout + result.stderr
        assert (tmp_path / "ct2" / "source.spm").exists() and (tmp_path / "ct2" / "target.spm").exists()


def test_the_server_translates_with_an_imported_model(imported, sources):
    from qkv.serve.app import create_app

    loaded = checkpoint.load(imported)
    expected = Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam_size=1), max_tokens=4096, max_sentences=32).translate(sources[:6])

    async def request():
        app = create_app(imported)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://qkv", timeout=30) as client:
                return await client.post("/v1/translate", json={"texts": sources[:6], "beam_size": 1})

    response = asyncio.run(request())
    assert response.status_code == 200 and response.json() == {"translations": expected}


def test_a_model_qkv_trained_exports_to_marian(random_checkpoint, tmp_path, capsys):
    """qkv's own joint tokenizer is a Marian tokenizer with the same SentencePiece model on both sides and
    its pieces as vocab.json: transformers then gives qkv's ids (text holding a special token's string,
    such as "</s>", aside), and the exported model qkv's logits (1e-5). A pre-LN model is refused."""
    out = tmp_path / "marian"
    check = tmp_path / "check.txt"
    lines = multi30k_lines("val", "en", 30) + multi30k_lines("val", "de", 30)
    check.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = in_process(capsys, "export", "--format", "marian", "--checkpoint", random_checkpoint, "--out", out, "--check-file", check)
    assert result.returncode == 0 and "ids on 60/60 sentences" in result.stdout, result.stdout + result.stderr
    loaded = checkpoint.load(random_checkpoint)
    hf_tok = transformers.MarianTokenizer.from_pretrained(out)
    exported = transformers.MarianMTModel.from_pretrained(out).eval()
    tok = loaded.tokenizer
    assert [hf_tok(s)["input_ids"] for s in lines] == [tok.encode(s) + [tok.eos_id] for s in lines]
    assert [hf_tok(text_target=s)["input_ids"] for s in lines] == [tok.encode(s) + [tok.eos_id] for s in lines]
    # the two known differences: a special token's text inside a sentence, and how <unk> is decoded
    assert hf_tok("a </s> b")["input_ids"] != tok.encode("a </s> b") + [tok.eos_id]
    assert hf_tok.decode([tok.unk_id], skip_special_tokens=True) == "" and tok.decode([tok.unk_id]) == " \u2047 "
    src = torch.tensor([tok.encode(lines[0]) + [tok.eos_id]])
    tgt = torch.tensor([[tok.bos_id, *tok.encode(lines[30])]])
    with torch.no_grad():
        torch.testing.assert_close(logits(exported, src, tgt), loaded.model(src, tgt), atol=1e-5, rtol=0)
    pre_ln = checkpoint.save(tmp_path / "pre-ln", type(loaded.model)(loaded.model.config.replace(norm_first=True)), tok)
    refused(in_process(capsys, "export", "--format", "marian", "--checkpoint", pre_ln, "--out", tmp_path / "x"), "export", "Marian is post-LN")
    assert not (tmp_path / "x").exists()


def test_fine_tuning_an_imported_model(imported, tmp_path, capsys):
    """`qkv train --init-from` on an imported model: the run keeps its Marian tokenizer, starts from its
    weights and lowers its perplexity on the new text; the result exports back to Marian with the original
    generation settings."""
    from qkv.infer.score import perplexity, score_pairs

    pairs = list(zip(multi30k_lines("train", "en", 200, start=1000), multi30k_lines("train", "de", 200, start=1000)))
    data = tmp_path / "mine.tsv"
    data.write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
    run = tmp_path / "run"
    result = qkv("train", "--init-from", imported, "--preset", "tiny", "--train-src", data, "--out", run, "--max-steps", "30",
                 "--no-progress", "--train", "eval_every=30", "threads=1", "average_last=1", "keep_last=1", "lr=3e-3")  # fmt: skip
    assert result.returncode == 0, result.stderr
    parent, child = checkpoint.load(imported), checkpoint.load(run / "final")
    assert isinstance(child.tokenizer, MarianTokenizer) and child.tokenizer.to_bytes() == parent.tokenizer.to_bytes()
    src, tgt = [s for s, _ in pairs[:64]], [t for _, t in pairs[:64]]
    before = perplexity(score_pairs(parent.model, parent.tokenizer, src, tgt))
    after = perplexity(score_pairs(child.model, child.tokenizer, src, tgt))
    assert after < 0.8 * before, (before, after)
    assert cli.main(["export", "--format", "marian", "--checkpoint", str(run / "final"), "--out", str(tmp_path / "marian"), "--check", "0"]) == 0
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "marian")
    assert (generation.num_beams, generation.max_length) == (4, 64)  # the original's search, kept through fine-tuning


def test_contributions_sum_back_on_an_imported_marian_model(imported, sources):
    """The decomposition is exact on Marian's layers too (post-LN, split sinusoids, final-logits bias)."""
    from conftest import assert_blocks_sum_back
    from qkv.data.corpus import collate
    from qkv.inspect.contributions import contributions

    loaded = checkpoint.load(imported)
    model, tok = loaded.model.double().eval(), loaded.tokenizer
    ids = [tok.encode(s) for s in sources[:3]]
    src, tgt_in, _ = collate(ids, [tok.encode_target("ein kleiner Test")] * 3, pad_id=tok.pad_id, bos_id=tok.bos_id, eos_id=tok.eos_id)
    assert_blocks_sum_back(model, src, tgt_in)
    found = contributions(model, src, tgt_in)
    assert ((found.source_share > 0) & (found.source_share <= 1)).all()

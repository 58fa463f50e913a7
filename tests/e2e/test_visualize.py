"""Attention capture on real decoding, heatmaps, the HTML page and `qkv attend`."""

import json
import re
import struct

import pytest
import torch

from qkv.io import checkpoint
from qkv.cli.main import main
from qkv.model.config import model_preset
from qkv.infer.search import DecodeConfig, search
from qkv.model.transformer import Transformer
from qkv.data.tokenizer import Tokenizer
from qkv.infer.translator import collate_sources
from qkv.inspect.visualize import _panels, attention_of, capture_attention, plot_attention, word_alignment, write_html

SENTENCES = ["a man rides a red bike", "two dogs play in the snow", "a woman reads a book", "children run on the beach"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    tokenizer = Tokenizer.train(SENTENCES * 5, 60, directory / "tok.model")
    torch.manual_seed(0)
    config = model_preset("tiny", src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id)
    model = Transformer(config).eval()
    checkpoint.save(directory / "model", model, tokenizer)
    return directory / "model"


def test_captured_weights_have_shapes_rows_sum_to_one_and_mask_the_future(model_dir):
    loaded = checkpoint.load(model_dir)
    cap = capture_attention(loaded.model, loaded.tokenizer, SENTENCES[0], DecodeConfig(beam_size=2, max_len_b=6))
    L, H = 2, 2
    S, T = len(cap.src_tokens), len(cap.tgt_tokens)
    assert cap.src_tokens[-1] == "</s>" and cap.tgt_tokens[-1] == "</s>"
    assert cap.encoder.shape == (L, H, S, S)
    assert cap.decoder_self.shape == (L, H, T, T)
    assert cap.cross.shape == (L, H, T, S)
    for w in (cap.encoder, cap.decoder_self, cap.cross):
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
    assert (cap.decoder_self.triu(diagonal=1) == 0).all()


def test_captured_cross_attention_is_that_of_the_returned_hypothesis(model_dir):
    loaded = checkpoint.load(model_dir)
    model, tok = loaded.model, loaded.tokenizer
    config = DecodeConfig(beam_size=3, max_len_b=6)
    cap = capture_attention(model, tok, SENTENCES[1], config)
    src = collate_sources([tok.encode(SENTENCES[1])], pad_id=tok.pad_id, eos_id=tok.eos_id)
    hyp = search(model, src, bos_id=tok.bos_id, eos_id=tok.eos_id, config=config)[0][0].tokens
    assert cap.tgt_tokens == tok.pieces([*hyp, tok.eos_id])
    with torch.no_grad():
        memory, mask, _ = model.encode(src)
        _, weights = model.decode(torch.tensor([[tok.bos_id, *hyp]]), memory, mask, need_weights=True)
    for layer in range(2):
        torch.testing.assert_close(cap.cross[layer], weights.cross[layer][0])


def test_padding_in_a_batch_gets_zero_cross_attention(model_dir):
    loaded = checkpoint.load(model_dir)
    tok = loaded.tokenizer
    ids = [tok.encode(SENTENCES[0]), tok.encode("a dog")]
    src = collate_sources(ids, pad_id=tok.pad_id, eos_id=tok.eos_id)
    with torch.no_grad():
        memory, mask, _ = loaded.model.encode(src)
        _, weights = loaded.model.decode(torch.full((2, 3), tok.bos_id), memory, mask, need_weights=True)
    short = len(ids[1]) + 1
    assert all((w[1, :, :, short:] == 0).all() for w in weights.cross)


def test_png_and_html_carry_the_tokens(model_dir, tmp_path):
    loaded = checkpoint.load(model_dir)
    cap = capture_attention(loaded.model, loaded.tokenizer, SENTENCES[2], DecodeConfig(beam_size=1, max_len_b=5))
    png = plot_attention(cap, tmp_path / "a.png")
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width >= 300 and height >= 200
    page = write_html(cap, tmp_path / "a.html").read_text(encoding="utf-8")
    for token in cap.src_tokens + cap.tgt_tokens:
        assert token.replace("</", "<\\/") in page  # inside <script>, "</" is escaped
    assert "<script>" in page and "http" not in page.split("<script>")[1]  # self-contained


def test_word_alignment_names_source_words(model_dir):
    loaded = checkpoint.load(model_dir)
    cap = capture_attention(loaded.model, loaded.tokenizer, SENTENCES[3], DecodeConfig(beam_size=1, max_len_b=5))
    source_words = SENTENCES[3].split()
    for _, src_word, weight in word_alignment(cap):
        assert src_word in source_words
        assert 0.0 <= weight <= 1.0 + 1e-6


def test_attend_command_writes_png_html_json(model_dir, tmp_path, capsys):
    out = tmp_path / "pic"
    code = main(["attend", "--checkpoint", str(model_dir), SENTENCES[0], "--out", str(out), "--json", str(tmp_path / "w.json"), "--beam", "1", "--kind", "enc-self", "--layer", "1"])
    assert code == 0
    assert (tmp_path / "pic.png").stat().st_size > 1000
    # what the command wrote is the model's attention on this sentence, not a label we passed in:
    # the JSON holds the weights capture_attention computes, and the page opens on layer 1 of enc-self
    loaded = checkpoint.load(model_dir)
    expected = capture_attention(loaded.model, loaded.tokenizer, SENTENCES[0], DecodeConfig(beam_size=1))
    written = json.loads((tmp_path / "w.json").read_text(encoding="utf-8"))
    assert written["src_tokens"] == expected.src_tokens and written["tgt_tokens"] == expected.tgt_tokens
    torch.testing.assert_close(torch.tensor(written["encoder"]), expected.encoder)
    torch.testing.assert_close(torch.tensor(written["cross"]), expected.cross)
    page = (tmp_path / "pic.html").read_text(encoding="utf-8")
    data = json.loads(re.search(r"const DATA = (.*?);\n", page).group(1).replace("<\\/", "</"))
    torch.testing.assert_close(torch.tensor(data["encoder"]), expected.encoder)
    assert '[k, k]), "enc-self");' in page and "refresh(0);" in page  # opens on the asked kind, layer 1 (0-based 0)
    out_text = capsys.readouterr().out
    assert f"translation: {expected.translation}" in out_text and "word alignment" in out_text
    assert main(["attend", "--checkpoint", str(model_dir), "x", "--out", str(out), "--layer", "9"]) == 2


def test_heads_are_numbered_from_one_like_layers(model_dir, tmp_path):
    loaded = checkpoint.load(model_dir)
    cap = capture_attention(loaded.model, loaded.tokenizer, SENTENCES[0], DecodeConfig(beam_size=1, max_len_b=5))
    titles = [title for title, _ in _panels(cap, "cross", -1, None)]
    assert titles == ["head 1", "head 2", "average of heads"]
    [(title, weights)] = _panels(cap, "cross", -1, 1)
    assert title == "head 2" and torch.equal(weights, cap.cross[-1, 1])
    out = str(tmp_path / "pic")
    assert main(["attend", "--checkpoint", str(model_dir), "x", "--out", out, "--beam", "1", "--head", "2"]) == 0
    assert main(["attend", "--checkpoint", str(model_dir), "x", "--out", out, "--beam", "1", "--head", "0"]) == 2
    assert main(["attend", "--checkpoint", str(model_dir), "x", "--out", out, "--beam", "1", "--head", "3"]) == 2


def test_attend_draws_contributions_and_says_whether_to_trust_the_translation(model_dir, tmp_path, capsys):
    """--kind alti draws ALTI+'s source share of each prediction (one panel: the heads together); the page
    and the JSON carry both contribution views; the printout gives the confidence and flags that
    `qkv score --confidence` gives this pair, and each word's share from the source."""
    from qkv.inspect.contributions import contributions
    from qkv.inspect.trust import assess, calibration_of
    from qkv.infer.translator import collate_sources

    out = tmp_path / "pic"
    assert main(["attend", "--checkpoint", str(model_dir), SENTENCES[0], "--out", str(out), "--json", str(tmp_path / "w.json"),
                 "--beam", "1", "--kind", "alti"]) == 0
    loaded = checkpoint.load(model_dir)
    tok = loaded.tokenizer
    written = json.loads((tmp_path / "w.json").read_text(encoding="utf-8"))
    id_of = {piece: i for i, piece in enumerate(tok.pieces(list(range(tok.vocab_size))))}
    hyp = [id_of[piece] for piece in written["tgt_tokens"][:-1]]  # the translation the command drew, without EOS
    src = collate_sources([tok.encode(SENTENCES[0])], pad_id=tok.pad_id, eos_id=tok.eos_id)
    found = contributions(loaded.model.eval(), src, torch.tensor([[tok.bos_id, *hyp]]))
    S = src.size(1)
    cap = attention_of(loaded.model, tok, SENTENCES[0], tok.encode(SENTENCES[0]), hyp, contributions=True)
    torch.testing.assert_close(torch.tensor(written["alti"])[:, 0], torch.stack([a[0, :, :S] for a in found.alti]).float())
    norms = torch.tensor(written["norm"])[:, 0]  # (L, T, S), rows scaled to 1
    torch.testing.assert_close(norms.sum(-1), torch.ones(norms.shape[:2]))
    assert [title for title, _ in _panels(cap, "alti", -1, None)] == ["all heads"]
    page = (tmp_path / "pic.html").read_text(encoding="utf-8")
    assert '"alti": ["tgt_tokens", "src_tokens", "alti"]' in page and '[k, k]), "alti");' in page
    (trust,) = assess(loaded.model, tok, [SENTENCES[0]], [cap.translation], calibration=calibration_of(loaded.path))
    printed = capsys.readouterr().out
    assert f"confidence:  {trust.confidence:.2f}" in printed and f"flags: {', '.join(trust.flags) or 'none'}" in printed
    shares = re.findall(r"from source (\d\.\d\d)", printed)
    assert shares == [f"{w['source']:.2f}" for w in trust.words]

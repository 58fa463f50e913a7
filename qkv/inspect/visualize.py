"""Seeing attention: capture every layer's and head's weights for a real translation, and draw them.

Dimension legend: L layers, H heads, S source tokens (with EOS), T target tokens (the translation + EOS).

``capture_attention`` first searches as ``qkv translate`` does (nothing is recorded, so normal
translation pays nothing), then runs one teacher-forced pass over the hypothesis it returned with
``need_weights=True``. Row t of the decoder weights is the query that *produced* target token t.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from qkv.errors import QkvError
from qkv.infer.search import DecodeConfig, search
from qkv.inspect.contributions import contributions as find_contributions
from qkv.io.outputs import output_file
from qkv.model.transformer import Transformer
from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.translator import collate_sources, suppressed_tokens

Kind = Literal["cross", "enc-self", "dec-self", "norm", "alti"]
KINDS: tuple[Kind, ...] = ("cross", "enc-self", "dec-self", "norm", "alti")
CONTRIBUTION_KINDS = ("norm", "alti")  # what each source token contributed, not where a head looked


@dataclass
class AttentionCapture:
    """The weights of one translated sentence. Each tensor is (L, H, queries, keys). With contributions
    (``qkv.inspect.contributions``), also per decoder layer, as one "head" (L, 1, T, S): ``norms``, the
    value norms ||sum_h alpha_ij f(x_j)|| scaled so that each row sums to 1, and ``alti``, ALTI+'s
    share of each source token in each prediction (a row sums to the source's share; the rest is the
    target prefix's)."""

    source: str
    translation: str
    src_tokens: list[str]  # S subword pieces, EOS last
    tgt_tokens: list[str]  # T subword pieces, EOS last
    encoder: Tensor  # (L, H, S, S)
    decoder_self: Tensor  # (L, H, T, T)
    cross: Tensor  # (L, H, T, S)
    norms: Tensor | None = None  # (L, 1, T, S)
    alti: Tensor | None = None  # (L, 1, T, S)
    alignment: Tensor | None = None  # (T, S): the alignment head's weights, for a model trained with one (Transformer.alignment_head)

    def weights(self, kind: Kind) -> Tensor:
        found = {"cross": self.cross, "enc-self": self.encoder, "dec-self": self.decoder_self, "norm": self.norms,
                 "alti": self.alti}[kind]
        if found is None:
            raise QkvError(f"this capture has no {kind} contributions: capture it with contributions=True")
        return found

    def axes(self, kind: Kind) -> tuple[list[str], list[str]]:
        """(query labels for the rows, key labels for the columns)."""
        return {
            "cross": (self.tgt_tokens, self.src_tokens),
            "enc-self": (self.src_tokens, self.src_tokens),
            "dec-self": (self.tgt_tokens, self.tgt_tokens),
        }.get(kind, (self.tgt_tokens, self.src_tokens))

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "translation": self.translation,
            "src_tokens": self.src_tokens,
            "tgt_tokens": self.tgt_tokens,
            "encoder": self.encoder.tolist(),
            "decoder_self": self.decoder_self.tolist(),
            "cross": self.cross.tolist(),
            **({} if self.norms is None else {"norm": self.norms.tolist(), "alti": self.alti.tolist()}),
        }


@torch.inference_mode()
def capture_attention(
    model: Transformer, tokenizer: TextTokenizer, sentence: str, config: DecodeConfig | None = None, *,
    contributions: bool = False,
) -> AttentionCapture:
    """Translate ``sentence`` and return all attention weights for the hypothesis the search returned
    (and with ``contributions``, what each source token contributed)."""
    model.eval()
    config = config or DecodeConfig()
    src_ids = tokenizer.encode(sentence)[: model.config.max_len - 1]
    src = collate_sources([src_ids], pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id).to(model.device)  # (1, S)
    hyp = search(model, src, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, config=config,
                 suppress=suppressed_tokens(tokenizer))[0][0].tokens
    return attention_of(model, tokenizer, sentence, src_ids, hyp, contributions=contributions)


@torch.inference_mode()
def attention_of(
    model: Transformer, tokenizer: TextTokenizer, sentence: str, src_ids: list[int], hyp: list[int], *,
    contributions: bool = False,
) -> AttentionCapture:
    """All attention weights of the model translating ``src_ids`` (the ids of ``sentence``) into ``hyp``
    (target ids without BOS and EOS): one teacher-forced pass with ``need_weights=True``; with
    ``contributions``, one more that decomposes every block (``qkv.inspect.contributions``)."""
    model.eval()
    src = collate_sources([src_ids], pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id).to(model.device)  # (1, S)
    tgt = torch.tensor([[tokenizer.bos_id, *hyp]], device=model.device)  # (1, T): BOS + hypothesis, what the decoder read
    memory, src_mask, encoder = model.encode(src, need_weights=True)
    _, weights = model.decode(tgt, memory, src_mask, need_weights=True)
    stack = lambda ws: torch.stack([w[0] for w in ws]).float().cpu()  # noqa: E731  L x (1, H, q, k) -> (L, H, q, k)
    norms = alti = None
    if contributions:
        found = find_contributions(model, src, tgt)
        S = src.size(1)
        norms = torch.stack([n[0] / n[0].sum(-1, keepdim=True).clamp(min=1e-12) for n in found.norms])  # (L, T, S)
        alti = torch.stack([a[0, :, :S] for a in found.alti])  # L x (1, T, S + T) -> (L, T, S): the source's columns
        norms, alti = norms[:, None].float().cpu(), alti[:, None].float().cpu()  # (L, 1, T, S)
    return AttentionCapture(
        norms=norms,
        alti=alti,
        source=sentence,
        translation=tokenizer.decode(hyp),
        src_tokens=tokenizer.pieces([*src_ids, tokenizer.eos_id]),
        tgt_tokens=tokenizer.pieces([*hyp, tokenizer.eos_id]),
        encoder=stack(encoder),
        decoder_self=stack(weights.decoder_self),
        cross=stack(weights.cross),
        alignment=_alignment_head(model, tgt, memory, src_mask, weights.cross),
    )


def _alignment_head(model: Transformer, tgt, memory, src_mask, cross) -> Tensor | None:
    """The alignment head's weights (T, S) of a model trained with one: the causal pass's own (``cross``,
    L x (1, H, T, S)), or a full-context head's pass of its own (``Transformer.alignment_head``)."""
    index = model.config.alignment_layer
    if index is None:
        return None
    head = model.alignment_head(tgt, memory, src_mask) if model.config.alignment_context == "full" else cross[index][:, 0]
    return head[0].float().cpu()


def group_words(pieces: list[str]) -> list[tuple[str, list[int]]]:
    """Group subword pieces into words (a piece starting with '▁' starts a word): (word, piece indices).
    EOS ("</s>") is a word of its own; pieces that make no text (a lone '▁' at the end) are dropped."""
    words: list[tuple[str, list[int]]] = []
    for i, piece in enumerate(pieces):
        if piece.startswith("▁") or not words or piece == "</s>":
            words.append((piece.lstrip("▁"), [i]))
        else:
            words[-1] = (words[-1][0] + piece, words[-1][1] + [i])
    return [(w, idx) for w, idx in words if w]


def word_weights(weights: Tensor, src_pieces: list[str], tgt_pieces: list[str]) -> Tensor:
    """(Tw, Sw): the piece weights (T, S) as word weights, EOS left out on both sides: a target word's row
    the mean of its pieces' rows, a source word's column the sum of its pieces' columns, so that a word
    split into many pieces is not favoured or penalised for it. Empty when either side has no word."""
    src_words = [cols for w, cols in group_words(src_pieces) if w != "</s>"]
    tgt_words = [rows for w, rows in group_words(tgt_pieces) if w != "</s>"]
    if not src_words or not tgt_words:
        return weights.new_zeros(len(tgt_words), len(src_words))
    # one index_add_ a side, not a small op a word (the documents' alignment pass reads every sentence)
    rows = torch.tensor([r for group in tgt_words for r in group], device=weights.device)
    row_word = torch.tensor([w for w, group in enumerate(tgt_words) for _ in group], device=weights.device)
    counts = torch.tensor([len(group) for group in tgt_words], device=weights.device, dtype=weights.dtype)
    by_word = weights.new_zeros(len(tgt_words), weights.size(1)).index_add_(0, row_word, weights[rows]) / counts[:, None]  # (Tw, S)
    cols = torch.tensor([c for group in src_words for c in group], device=weights.device)
    col_word = torch.tensor([w for w, group in enumerate(src_words) for _ in group], device=weights.device)
    return weights.new_zeros(len(tgt_words), len(src_words)).index_add_(1, col_word, by_word[:, cols])  # (Tw, Sw)


def align_words(weights: Tensor, src_pieces: list[str], tgt_pieces: list[str]) -> list[tuple[int, int, float]]:
    """For each target word, the source word it attends to most: (source word, target word, weight),
    0-based word indices without EOS. weights: (T, S) over the pieces (rows: target, columns: source),
    read as ``word_weights``."""
    mass = word_weights(weights, src_pieces, tgt_pieces)  # (Tw, Sw)
    if mass.numel() == 0:
        return []
    best = mass.argmax(dim=1).tolist()  # (Tw,): the first of equal maxima
    return [(i, j, float(mass[j, i])) for j, i in enumerate(best)]


def align_source_words(weights: Tensor, src_pieces: list[str], tgt_pieces: list[str]) -> list[tuple[int, int, float]]:
    """For each source word, the target word that attends to it most: (source word, target word, weight),
    0-based word indices without EOS, the other direction of ``align_words`` on the same ``word_weights``."""
    mass = word_weights(weights, src_pieces, tgt_pieces)  # (Tw, Sw)
    if mass.numel() == 0:
        return []
    best = mass.argmax(dim=0).tolist()  # (Sw,)
    return [(i, j, float(mass[j, i])) for i, j in enumerate(best)]


def word_alignment(capture: AttentionCapture, layer: int = -1) -> list[tuple[str, str, float]]:
    """For each target word, the source word it attended to most (head-averaged cross-attention):
    (target word, source word, weight) triples; EOS is left out."""
    src_words = [w for w, _ in group_words(capture.src_tokens) if w != "</s>"]
    tgt_words = [w for w, _ in group_words(capture.tgt_tokens) if w != "</s>"]
    weights = capture.cross[layer].mean(dim=0)  # (H, T, S) -> (T, S)
    return [(tgt_words[j], src_words[i], w) for i, j, w in align_words(weights, capture.src_tokens, capture.tgt_tokens)]


def token_alignment(capture: AttentionCapture, layer: int = -1) -> list[tuple[str, str, float]]:
    """For each target subword piece, the source piece it attended to most (head-averaged
    cross-attention): finer than ``word_alignment`` where a "word" is many pieces ("2017-05-09").
    EOS and bare word-boundary pieces are left out on both sides."""
    weights = capture.cross[layer].mean(dim=0)  # (H, T, S) -> (T, S)
    keep_src = [j for j, piece in enumerate(capture.src_tokens) if piece not in ("</s>", "\u2581")]
    alignment = []
    for t, piece in enumerate(capture.tgt_tokens):
        if piece in ("</s>", "\u2581") or not keep_src:
            continue
        best = max(keep_src, key=lambda j: float(weights[t, j]))
        alignment.append((piece, capture.src_tokens[best], float(weights[t, best])))
    return alignment


def _panels(capture: AttentionCapture, kind: Kind, layer: int, head: int | None) -> list[tuple[str, Tensor]]:
    weights = capture.weights(kind)[layer]  # (H, q, k)
    if kind in CONTRIBUTION_KINDS:  # the heads together
        return [("all heads", weights[0])]
    heads = [(f"head {h + 1}", weights[h]) for h in range(weights.size(0))]
    if head is not None:
        return [heads[head]]
    return heads + [("average of heads", weights.mean(0))]


def plot_attention(
    capture: AttentionCapture, path: str | Path, *, kind: Kind = "cross", layer: int = -1, head: int | None = None
) -> Path:
    """Heatmaps (keys on x, queries on y) of every head of one layer plus their average, as a PNG.

    `layer` and `head` are Python indices (0-based, negative from the end); titles number heads from 1.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols = capture.axes(kind)
    panels = _panels(capture, kind, layer, head)
    n_layers = capture.weights(kind).size(0)
    per_row = min(len(panels), 3)
    grid_rows = (len(panels) + per_row - 1) // per_row
    cell = 0.42
    width = max(4.0, len(cols) * cell + 1.5)
    height = max(3.0, len(rows) * cell + 1.2)
    fig, axes = plt.subplots(grid_rows, per_row, figsize=(width * per_row, height * grid_rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (title, w) in zip(axes.flat, panels):
        ax.imshow(w.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=9)
        ax.set_yticks(range(len(rows)), rows, fontsize=9)
        if len(rows) * len(cols) <= 400:  # label cells while they stay legible
            for i in range(w.size(0)):
                for j in range(w.size(1)):
                    value = float(w[i, j])
                    if value >= 0.1:
                        ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=7, color="black" if value > 0.6 else "white")
        ax.set_title(title, fontsize=10)
    label = {"cross": "cross-attention (target rows, source columns)", "enc-self": "encoder self-attention",
             "dec-self": "decoder masked self-attention", "norm": "value-norm contributions, rows scaled to 1",
             "alti": "ALTI+ contributions of the source (rows sum to the source's share)"}[kind]
    layer_no = layer % n_layers + 1
    fig.suptitle(f"{label}, layer {layer_no} of {n_layers}\n{capture.source}  ->  {capture.translation}", fontsize=11)
    fig.tight_layout()
    return save_png(fig, path, dpi=90)


def save_png(fig, path: str | Path, *, dpi: int) -> Path:
    """Write a matplotlib figure to ``path`` as PNG, whole or not at all and marked as qkv's output
    (``qkv.io.outputs.output_file``; a symlink is replaced, not followed; the commands check their
    outputs before), then close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        with output_file(path, force=True, binary=True, provenance=False) as handle:
            fig.savefig(handle, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return path


_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>qkv attention: %(title)s</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { width: 2.6em; height: 1.9em; text-align: center; font-size: 12px; }
th { font-weight: normal; white-space: nowrap; }
th.col { height: 6em; vertical-align: bottom; }
th.col div { transform: rotate(-60deg); transform-origin: left bottom; width: 1em; margin-left: 1.3em; }
th.row { text-align: right; padding-right: 0.5em; cursor: pointer; }
tr.hot th.row { background: #ffd54f; }
tr.hot td { outline: 2px solid #ff6f00; }
th.col.lit { background: #ffd54f; }
#rowinfo { min-height: 1.5em; font-family: monospace; }
select { margin-right: 1em; }
</style></head><body>
<h2>%(title)s</h2>
<p><b>source</b>: %(source)s<br><b>translation</b>: %(translation)s</p>
<label>kind <select id="kind"></select></label>
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
<p id="rowinfo">hover a query token (row) to see where it looks</p>
<div id="grid"></div>
<script>
const DATA = %(data)s;
const KINDS = {"cross": ["tgt_tokens", "src_tokens", "cross"], "enc-self": ["src_tokens", "src_tokens", "encoder"],
               "dec-self": ["tgt_tokens", "tgt_tokens", "decoder_self"]};
if (DATA.alti) Object.assign(KINDS, {"norm": ["tgt_tokens", "src_tokens", "norm"], "alti": ["tgt_tokens", "src_tokens", "alti"]});
const $ = (id) => document.getElementById(id);
function options(select, values, chosen) {
  select.innerHTML = values.map((v) => `<option value="${v[0]}">${v[1]}</option>`).join("");
  select.value = chosen;
}
function color(w) { const l = 97 - 70 * w; return `hsl(220, 70%%, ${l}%%)`; }
function esc(s) { return s.replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c])); }
function render() {
  const [rowKey, colKey, wKey] = KINDS[$("kind").value];
  const layers = DATA[wKey], layer = +$("layer").value, head = $("head").value;
  const heads = layers[layer];
  const w = head === "avg" ? heads[0].map((row, i) => row.map((_, j) => heads.reduce((s, h) => s + h[i][j], 0) / heads.length)) : heads[+head];
  const rows = DATA[rowKey], cols = DATA[colKey];
  let out = "<table><tr><th></th>" + cols.map((c, j) => `<th class="col" data-j="${j}"><div>${esc(c)}</div></th>`).join("") + "</tr>";
  w.forEach((row, i) => {
    out += `<tr data-i="${i}"><th class="row">${esc(rows[i])}</th>` +
      row.map((v, j) => `<td style="background:${color(v)}" title="${esc(rows[i])} -> ${esc(cols[j])}: ${v.toFixed(3)}">${v >= 0.1 ? v.toFixed(1) : ""}</td>`).join("") + "</tr>";
  });
  $("grid").innerHTML = out + "</table>";
  document.querySelectorAll("#grid tr[data-i]").forEach((tr) => tr.addEventListener("mouseenter", () => {
    document.querySelectorAll("#grid tr.hot").forEach((t) => t.classList.remove("hot"));
    document.querySelectorAll("#grid th.col.lit").forEach((t) => t.classList.remove("lit"));
    tr.classList.add("hot");
    const i = +tr.dataset.i, best = w[i].map((v, j) => [v, j]).sort((a, b) => b[0] - a[0]).slice(0, 3);
    best.forEach(([, j]) => document.querySelector(`#grid th.col[data-j="${j}"]`).classList.add("lit"));
    $("rowinfo").textContent = `${rows[i]} -> ` + best.map(([v, j]) => `${cols[j]} ${v.toFixed(2)}`).join(", ");
  }));
}
function refresh(initialLayer) {
  const [, , wKey] = KINDS[$("kind").value];
  const nLayers = DATA[wKey].length, nHeads = DATA[wKey][0].length;
  const layer = initialLayer ?? Math.min(+$("layer").value, nLayers - 1);
  options($("layer"), [...Array(nLayers).keys()].map((l) => [l, `${l + 1}`]), layer);
  options($("head"), [["avg", "average"], ...[...Array(nHeads).keys()].map((h) => [h, `${h + 1}`])], $("head").value || "avg");
  render();
}
options($("kind"), Object.keys(KINDS).map((k) => [k, k]), %(kind)s);
["layer", "head"].forEach((id) => $(id).addEventListener("change", render));
$("kind").addEventListener("change", () => refresh());
refresh(%(layer)s);
</script></body></html>
"""


def write_html(capture: AttentionCapture, path: str | Path, *, kind: Kind = "cross", layer: int = -1) -> Path:
    """One self-contained HTML page: a heatmap per layer/head/kind; hover a row to see its attention."""
    n_layers = capture.weights(kind).size(0)
    data = capture.to_json()
    page = _HTML % {
        "title": html.escape(f"{kind} attention"),
        "source": html.escape(capture.source),
        "translation": html.escape(capture.translation),
        "data": json.dumps(data, ensure_ascii=False).replace("</", "<\\/"),
        "kind": json.dumps(kind),
        "layer": layer % n_layers,
    }
    path = Path(path)
    with output_file(path, force=True, provenance=False) as handle:  # whole or not at all; a symlink is replaced, not followed
        handle.write(page)
    return path

"""A beam you can watch: every step of beam search on one sentence, as data, a tree picture and a page.

``trace_beam`` runs ``qkv.infer.search.beam_search`` with a trace: at each step the live beams and the 2K
best one-token extensions it considered, each marked "live" (kept as a beam), "finished" (ended with
EOS, or at the length limit, and kept as a hypothesis with its length-normalised score) or "pruned".
A beam is stored as a back-pointer: the beam of the step before that it extends (``parent``), the
token it adds and its total log-probability, so a trace grows with its steps, not with their square
(a prefix is rebuilt by following the pointers, only where one is shown). The tree has one node per
prefix: its children are the extensions considered, and the returned translation is the path drawn bold.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from qkv.errors import QkvError
from qkv.infer.search import DecodeConfig, beam_search
from qkv.model.transformer import Transformer
from qkv.data.text_tokenizer import TextTokenizer
from qkv.infer.translator import collate_sources, suppressed_tokens

COLORS = {"live": "#1f77b4", "finished": "#2ca02c", "pruned": "#b0b0b0"}


@dataclass
class BeamTrace:
    source: str
    translation: str
    beam_size: int
    length_penalty: float
    # One record a step: {"step", "beams": [{"parent", "token", "score"}], "candidates": [{"beam",
    # "token", "score", "fate", "piece"} (+ "normalized" when finished)]}. Beam j of step s + 1 is the
    # j-th live candidate of step s: it extends beam "parent" of step s with "token". Step 0's one
    # beam is BOS alone (parent and token null).
    steps: list[dict]
    best: list[int]  # the returned hypothesis' tokens (without EOS)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=1)


class SearchSteps(list):
    """A list for ``beam_search(..., trace=)`` that keeps each step's beams as back-pointers: the
    search hands it ``qkv.infer.search.trace_step`` records, each beam with its whole prefix, and it keeps
    only the step each beam came from and the token it added (the prefixes would make a trace of T
    steps hold T^2 tokens). ``pieces`` names the candidates' tokens ("piece")."""

    def __init__(self, pieces: Callable[[list[int]], list[str]]) -> None:
        super().__init__()
        self.pieces = pieces

    def append(self, record: dict) -> None:
        beams = record["beams"]
        if not self:
            pointers = [{"parent": None, "token": None, "score": b["score"]} for b in beams]
        else:  # the live candidates of the step before, in order, are this step's beams
            live = [c for c in self[-1]["candidates"] if c["fate"] == "live"]
            pointers = [{"parent": c["beam"], "token": c["token"], "score": c["score"]} for c in live]
            assert [(p["token"], p["score"]) for p in pointers] == [(b["tokens"][-1], b["score"]) for b in beams]
        pieces = self.pieces([c["token"] for c in record["candidates"]])
        candidates = [{**c, "piece": piece} for c, piece in zip(record["candidates"], pieces)]
        super().append({"step": record["step"], "beams": pointers, "candidates": candidates})


def trace_beam(model: Transformer, tokenizer: TextTokenizer, sentence: str, config: DecodeConfig) -> BeamTrace:
    """Translate ``sentence`` by beam search (``config.beam_size`` >= 2) and record every step."""
    if config.beam_size < 2 or config.sampling:
        raise QkvError("a beam trace needs beam search: --beam 2 or more, without --sampling")
    src_ids = tokenizer.encode(sentence)[: model.config.max_len - 1]
    src = collate_sources([src_ids], pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id).to(model.device)  # (1, S)
    steps = SearchSteps(tokenizer.pieces)
    model.eval()
    hyps = beam_search(model, src, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, config=config, trace=steps,
                       suppress=suppressed_tokens(tokenizer))[0]
    best = hyps[0].tokens if hyps else []
    return BeamTrace(sentence, tokenizer.decode(best), config.beam_size, config.length_penalty, list(steps), best)


def tree(trace: BeamTrace) -> tuple[list[dict], list[int]]:
    """The search tree: one node per prefix (node 0 is BOS alone, then one per candidate, in the order
    of the steps and their candidates), each with its depth, token, piece, score, fate, normalized
    score (finished ones) and parent node; and the returned translation's path (node numbers, root
    first, ending in the node that finished it). Linear in the trace's size."""
    nodes = [{"depth": 0, "token": None, "piece": "<s>", "score": 0.0, "fate": "live", "parent": None, "normalized": None}]
    beam_nodes = [0]  # the node of each beam of the current step
    for record in trace.steps:
        made = {}  # (beam, token) -> node, for this step's candidates
        for c in record["candidates"]:
            parent = beam_nodes[c["beam"]]
            made[c["beam"], c["token"]] = len(nodes)
            nodes.append({"depth": nodes[parent]["depth"] + 1, "token": c["token"], "piece": c["piece"], "score": c["score"],
                          "fate": c["fate"], "parent": parent, "normalized": c.get("normalized")})
        beam_nodes = [made[c["beam"], c["token"]] for c in record["candidates"] if c["fate"] == "live"]
    return nodes, _best_path(nodes, trace.best)


def prefix(nodes: list[dict], node: int) -> list[int]:
    """The tokens from the root to ``node``, by following its parents."""
    tokens = []
    while nodes[node]["parent"] is not None:
        tokens.append(nodes[node]["token"])
        node = nodes[node]["parent"]
    return tokens[::-1]


def _best_path(nodes: list[dict], best: list[int]) -> list[int]:
    """The path to the finished node of the returned hypothesis: the best normalized score among the
    finished candidates (the search returns the best it kept), whose prefix is ``best`` (and EOS, if
    it did not end at the length limit)."""
    finished = sorted((i for i, n in enumerate(nodes) if n["fate"] == "finished"), key=lambda i: -nodes[i]["normalized"])
    end = next((i for i in finished if prefix(nodes, i) in (best, best + [nodes[i]["token"]])), None)
    path = []
    while end is not None:
        path.append(end)
        end = nodes[end]["parent"]
    return path[::-1] or [0]


def _layout(nodes: list[dict]) -> list[tuple[float, float]]:
    """x = depth; y = rank within the depth by score (best at the top)."""
    by_depth: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        by_depth.setdefault(node["depth"], []).append(i)
    where = [(0.0, 0.0)] * len(nodes)
    for depth, ids in by_depth.items():
        for rank, i in enumerate(sorted(ids, key=lambda i: -nodes[i]["score"])):
            where[i] = (float(depth), float(-rank))
    return where


def draw_trace(trace: BeamTrace, path: str | Path) -> Path:
    """The search tree as a PNG: nodes colored by fate, the returned translation's path bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes, best = tree(trace)
    where, on_path = _layout(nodes), set(best)
    depth = max(n["depth"] for n in nodes)
    height = max(-y for _, y in where) + 1
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * (depth + 1)), max(3.0, 0.45 * height + 1.2)))
    for i, node in enumerate(nodes):
        x, y = where[i]
        if node["parent"] is not None:
            px, py = where[node["parent"]]
            bold = i in on_path
            ax.plot([px, x], [py, y], color="black" if bold else "#cccccc", lw=2.2 if bold else 0.8, zorder=1)
        label = node["piece"] + (f"\n{node['normalized']:.2f}" if node["normalized"] is not None else f"\n{node['score']:.2f}")
        ax.text(x, y, label, ha="center", va="center", fontsize=7, zorder=2,
                bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": COLORS[node["fate"]], "lw": 2 if i in on_path else 1})
    for fate, color in COLORS.items():
        ax.plot([], [], color=color, lw=3, label=fate)
    ax.legend(loc="lower left", fontsize=7, frameon=False)
    ax.set_title(f"beam {trace.beam_size}: {trace.source!r} -> {trace.translation!r}", fontsize=9)
    ax.set_xlim(-0.6, depth + 0.6)
    ax.set_ylim(-height + 0.4, 0.6)
    ax.set_xlabel("output position (step)")
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    from qkv.inspect.visualize import save_png

    return save_png(fig, path, dpi=120)


def trace_html(trace: BeamTrace) -> str:
    """A self-contained page: the tree as inline SVG, then every step as a table. Each candidate's row
    links to the node it extends (``#n<node>``) rather than spelling out its prefix, which would make
    the page grow with the square of the steps."""
    nodes, best = tree(trace)
    where, on_path = _layout(nodes), set(best)
    dx, dy = 110, 34
    depth = max(n["depth"] for n in nodes)
    height = max(-y for _, y in where) + 1
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{(depth + 1) * dx + 40}" height="{int(height) * dy + 20}">']
    xy = [(30 + x * dx, 20 - y * dy) for x, y in where]
    for i, node in enumerate(nodes):
        if node["parent"] is not None:
            (x1, y1), (x2, y2) = xy[node["parent"]], xy[i]
            style = 'stroke="black" stroke-width="2.5"' if i in on_path else 'stroke="#cccccc"'
            svg.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" {style}/>')
    for i, node in enumerate(nodes):
        x, y = xy[i]
        score = node["normalized"] if node["normalized"] is not None else node["score"]
        normalized = f", normalized {node['normalized']:.3f}" if node["normalized"] is not None else ""
        title = html.escape(f"{node['fate']}: log-probability {node['score']:.3f}{normalized}")
        svg.append(f'<g id="n{i}"><title>{title}</title><rect x="{x - 40}" y="{y - 12}" width="80" height="24" rx="5" fill="white" '
                   f'stroke="{COLORS[node["fate"]]}" stroke-width="{3 if i in on_path else 1.5}"/>'
                   f'<text x="{x}" y="{y + 4}" font-size="10" text-anchor="middle">{html.escape(node["piece"])} {score:.2f}</text></g>')
    svg.append("</svg>")
    rows, i = [], 0
    for record in trace.steps:
        for c in record["candidates"]:
            i += 1  # tree() numbers the candidates' nodes in this order, from 1
            parent = nodes[i]["parent"]
            extends = f'<a href="#n{parent}">beam {c["beam"]}: {html.escape(nodes[parent]["piece"])}</a>'
            norm = f"{c['normalized']:.3f}" if "normalized" in c else ""
            rows.append(f'<tr><td>{record["step"] + 1}</td><td>{extends}</td><td>{html.escape(c["piece"])}</td><td>{c["score"]:.3f}</td>'
                        f'<td>{norm}</td><td style="color:{COLORS[c["fate"]]}">{c["fate"]}</td></tr>')
    title = html.escape(f"beam {trace.beam_size}: {trace.source} -> {trace.translation}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>body{{font-family:sans-serif}}"
            f"td,th{{padding:2px 8px;text-align:left}}</style></head><body><h2>{title}</h2>"
            f"<p>Each node is a prefix with its total log-probability (finished hypotheses: divided by the length "
            f"penalty, alpha {trace.length_penalty}); blue: kept as a beam, green: finished, grey: pruned. The bold "
            f"path is the translation returned.</p>{''.join(svg)}<h3>Every candidate, step by step</h3>"
            f"<p>A candidate extends a beam of its step: the link leads to that beam's node (its last piece shown).</p><table>"
            f"<tr><th>step</th><th>extends</th><th>token</th><th>log-probability</th><th>normalized</th><th>fate</th></tr>"
            f"{''.join(rows)}</table></body></html>")

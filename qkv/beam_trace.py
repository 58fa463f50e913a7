"""A beam you can watch: every step of beam search on one sentence, as data, a tree picture and a page.

``trace_beam`` runs ``qkv.decode.beam_search`` with a trace: at each step the live beams (their
tokens and total log-probability) and the 2K best one-token extensions it considered, each marked
"live" (kept as a beam), "finished" (ended with EOS, or at the length limit, and kept as a
hypothesis with its length-normalised score) or "pruned". The tree has one node per prefix:
its children are the extensions considered, and the returned translation is the path drawn bold.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from qkv.decode import DecodeConfig, beam_search
from qkv.model import Transformer
from qkv.tokenizer import Tokenizer
from qkv.translate import collate_sources, suppressed_tokens

COLORS = {"live": "#1f77b4", "finished": "#2ca02c", "pruned": "#b0b0b0"}


@dataclass
class BeamTrace:
    source: str
    translation: str
    beam_size: int
    length_penalty: float
    steps: list[dict]  # qkv.decode.trace_step records, with "piece" added to each candidate
    best: list[int]  # the returned hypothesis' tokens (without EOS)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=1)


def trace_beam(model: Transformer, tokenizer: Tokenizer, sentence: str, config: DecodeConfig) -> BeamTrace:
    """Translate ``sentence`` by beam search (``config.beam_size`` >= 2) and record every step."""
    if config.beam_size < 2 or config.sampling:
        raise ValueError("a beam trace needs beam search: --beam 2 or more, without --sampling")
    src_ids = tokenizer.encode(sentence)[: model.config.max_len - 1]
    src = collate_sources([src_ids], pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id).to(model.device)  # (1, S)
    steps: list[dict] = []
    model.eval()
    hyps = beam_search(model, src, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, config=config, trace=steps,
                       suppress=suppressed_tokens(tokenizer))[0]
    for record in steps:
        for candidate in record["candidates"]:
            candidate["piece"] = tokenizer.pieces([candidate["token"]])[0]
    best = hyps[0].tokens if hyps else []
    return BeamTrace(sentence, tokenizer.decode(best), config.beam_size, config.length_penalty, steps, best)


def tree(trace: BeamTrace) -> tuple[dict[tuple, dict], list[tuple]]:
    """Nodes of the search tree keyed by prefix (token tuples), each with its depth, piece, score,
    fate and parent; and the returned translation's path (its prefixes, root first)."""
    nodes: dict[tuple, dict] = {(): {"depth": 0, "piece": "<s>", "score": 0.0, "fate": "live", "parent": None}}
    for record in trace.steps:
        beams = record["beams"]
        for c in record["candidates"]:
            parent = tuple(beams[c["beam"]]["tokens"])
            node = parent + (c["token"],)
            nodes[node] = {"depth": len(node), "piece": c["piece"], "score": c["score"], "fate": c["fate"],
                           "parent": parent, "normalized": c.get("normalized")}
    path = [tuple(trace.best[:i]) for i in range(len(trace.best) + 1)]
    ends = [p for p, n in nodes.items() if n["fate"] == "finished" and p[:-1] == tuple(trace.best)]
    return nodes, path + ends[:1]  # the best path ends in its finishing node (EOS)


def _layout(nodes: dict[tuple, dict]) -> dict[tuple, tuple[float, float]]:
    """x = depth; y = rank within the depth by score (best at the top)."""
    by_depth: dict[int, list[tuple]] = {}
    for prefix, node in nodes.items():
        by_depth.setdefault(node["depth"], []).append(prefix)
    where = {}
    for depth, prefixes in by_depth.items():
        for rank, prefix in enumerate(sorted(prefixes, key=lambda p: -nodes[p]["score"])):
            where[prefix] = (float(depth), float(-rank))
    return where


def draw_trace(trace: BeamTrace, path: str | Path) -> Path:
    """The search tree as a PNG: nodes colored by fate, the returned translation's path bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes, best = tree(trace)
    where, on_path = _layout(nodes), set(best)
    depth = max(n["depth"] for n in nodes.values())
    height = max(-y for _, y in where.values()) + 1
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * (depth + 1)), max(3.0, 0.45 * height + 1.2)))
    for prefix, node in nodes.items():
        x, y = where[prefix]
        if node["parent"] is not None:
            px, py = where[node["parent"]]
            bold = prefix in on_path
            ax.plot([px, x], [py, y], color="black" if bold else "#cccccc", lw=2.2 if bold else 0.8, zorder=1)
        label = node["piece"] + (f"\n{node['normalized']:.2f}" if node.get("normalized") is not None else f"\n{node['score']:.2f}")
        ax.text(x, y, label, ha="center", va="center", fontsize=7, zorder=2,
                bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": COLORS[node["fate"]], "lw": 2 if prefix in on_path else 1})
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
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def trace_html(trace: BeamTrace) -> str:
    """A self-contained page: the tree as inline SVG, then every step as a table."""
    nodes, best = tree(trace)
    where, on_path = _layout(nodes), set(best)
    dx, dy = 110, 34
    depth = max(n["depth"] for n in nodes.values())
    height = max(-y for _, y in where.values()) + 1
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{(depth + 1) * dx + 40}" height="{int(height) * dy + 20}">']
    xy = {p: (30 + x * dx, 20 - y * dy) for p, (x, y) in where.items()}
    for prefix, node in nodes.items():
        if node["parent"] is not None:
            (x1, y1), (x2, y2) = xy[node["parent"]], xy[prefix]
            style = 'stroke="black" stroke-width="2.5"' if prefix in on_path else 'stroke="#cccccc"'
            svg.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" {style}/>')
    for prefix, node in nodes.items():
        x, y = xy[prefix]
        score = node["normalized"] if node.get("normalized") is not None else node["score"]
        title = html.escape(f"{node['fate']}: log-probability {node['score']:.3f}" + (f", normalized {node['normalized']:.3f}" if node.get("normalized") is not None else ""))
        svg.append(f'<g><title>{title}</title><rect x="{x - 40}" y="{y - 12}" width="80" height="24" rx="5" fill="white" '
                   f'stroke="{COLORS[node["fate"]]}" stroke-width="{3 if prefix in on_path else 1.5}"/>'
                   f'<text x="{x}" y="{y + 4}" font-size="10" text-anchor="middle">{html.escape(node["piece"])} {score:.2f}</text></g>')
    svg.append("</svg>")
    rows = []
    for record in trace.steps:
        beams = record["beams"]
        for c in record["candidates"]:
            tokens = beams[c["beam"]]["tokens"]
            parent = html.escape(" ".join(nodes[tuple(tokens[: i + 1])]["piece"] for i in range(len(tokens))) or "<s>")
            norm = f"{c['normalized']:.3f}" if "normalized" in c else ""
            rows.append(f'<tr><td>{record["step"] + 1}</td><td>{parent}</td><td>{html.escape(c["piece"])}</td><td>{c["score"]:.3f}</td>'
                        f'<td>{norm}</td><td style="color:{COLORS[c["fate"]]}">{c["fate"]}</td></tr>')
    title = html.escape(f"beam {trace.beam_size}: {trace.source} -> {trace.translation}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>body{{font-family:sans-serif}}"
            f"td,th{{padding:2px 8px;text-align:left}}</style></head><body><h2>{title}</h2>"
            f"<p>Each node is a prefix with its total log-probability (finished hypotheses: divided by the length "
            f"penalty, alpha {trace.length_penalty}); blue: kept as a beam, green: finished, grey: pruned. The bold "
            f"path is the translation returned.</p>{''.join(svg)}<h3>Every candidate, step by step</h3><table>"
            f"<tr><th>step</th><th>extends</th><th>token</th><th>log-probability</th><th>normalized</th><th>fate</th></tr>"
            f"{''.join(rows)}</table></body></html>")

"""What each extra costs against plain translation, per model: the table and picture of docs/benchmarks.md (f).

    python -m benchmarks.extras --model "README's model" benchmarks/results/glossary-substitution \\
        benchmarks/results/numbers/cost.json benchmarks/results/trust/cost.json \\
        --model "6-1 student" benchmarks/results/glossary-student-6-1 \\
        benchmarks/results/numbers/cost-student-6-1.json benchmarks/results/trust/cost-student-6-1.json \\
        --model "README's model, CTranslate2 int8" benchmarks/results/glossary-ct2 \\
        benchmarks/results/numbers/cost-ct2.json benchmarks/results/trust/cost-ct2.json \\
        --model "6-1 student, CTranslate2 int8" benchmarks/results/glossary-ct2-student-6-1 \\
        benchmarks/results/numbers/cost-ct2-student-6-1.json benchmarks/results/trust/cost-ct2-student-6-1.json \\
        --out benchmarks/results/extras

Reads what the three benchmarks wrote (nothing is timed here): ``benchmarks.glossary``'s ``val.json`` in
each glossary directory (the mended ``--glossary`` row and the search-alone row, each against the same
run's plain row; the exact-form and inflected sets), ``benchmarks.number_lines time``'s JSON and
``benchmarks.trust_cost``'s. Writes ``extras.md`` (a row a model and extra: the ratio, and the run it
came from) and ``extras.png`` (the ratios as bars, one group an extra, one bar a model; 1 is plain).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


Row = tuple[str, str, float, str]  # (extra, the lines it ran on, time against plain, what it gave)


def _glossary_rows(directory: Path) -> list[Row]:
    data = json.loads((directory / "val.json").read_text(encoding="utf-8"))
    rows = []
    for name, found in data["sets"].items():
        cells = next(iter(found["by_beam"].values()))
        plain = cells["none"]["seconds"]
        for row, extra in (("glossary", "--glossary"), ("search", "--glossary by search alone")):
            if row not in cells:  # a run of some rows only (--rows)
                continue
            rows.append((extra, f"val {name} set ({found['sentences']} sentences)", cells[row]["seconds"] / plain,
                         f"{cells[row]['any_form']:.1%} of terms used"))
    return rows


def _numbers_rows(path: Path) -> list[Row]:
    data = json.loads(path.read_text(encoding="utf-8"))
    lines = f"{data['lines']} val lines"
    return [(extra, lines, data["rows"][row]["ratio"], f"{data['rows'][row]['hold_every_number']} of {data['lines']} hold every number")
            for row, extra in (("numbers", "--numbers"), ("numbers, search alone", "--numbers by search alone"))]


def _confidence_rows(path: Path) -> list[Row]:
    data = json.loads(path.read_text(encoding="utf-8"))
    ratios = data["ratio_per_repeat"]
    return [("--confidence", f"{data['lines']} test lines, whole commands", data["ratio_median"],
             f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} repeats")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs=4, action="append", required=True,
                        metavar=("NAME", "GLOSSARY_DIR", "NUMBERS_JSON", "CONFIDENCE_JSON"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    table = {name: _glossary_rows(Path(g)) + _numbers_rows(Path(n)) + _confidence_rows(Path(c))
             for name, g, n, c in args.model}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| model | extra | lines | time against plain | what it gave |", "|---|---|---|---:|---|"]
    lines += [f"| {model} | `{extra}` | {where} | {ratio:.2f}x | {note} |"
              for model, rows in table.items() for extra, where, ratio, note in rows]
    (out / "extras.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "extras.json").write_text(json.dumps({m: [{"extra": e, "lines": w, "ratio": round(r, 3), "note": n} for e, w, r, n in rows]
                                                 for m, rows in table.items()}, indent=1) + "\n", encoding="utf-8")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(e, w) for e, w, _, _ in next(iter(table.values()))]  # a bar group for each (extra, lines)
    width = 0.8 / len(table)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for k, (model, rows) in enumerate(table.items()):
        ratios = {(e, w): r for e, w, r, _ in rows}
        present = [i for i, c in enumerate(cells) if c in ratios]  # a model without a row gets no bar there
        bars = ax.bar([i + k * width for i in present], [ratios[cells[i]] for i in present], width, label=model)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log", base=2)  # 1.2x and 16x on one picture
    ticks = [1, 1.25, 1.5, 2, 4, 8, 16]
    ax.set_yticks(ticks, [f"{t:g}x" for t in ticks])
    ax.set_ylim(0.9, 20)
    ax.set_xticks([i + width * (len(table) - 1) / 2 for i in range(len(cells))])
    ax.set_xticklabels([f"{e.replace(' by ', chr(10) + 'by ')}\n{w.split(' (')[0].split(',')[0]}" for e, w in cells], fontsize=7)
    ax.set_ylabel("time against plain translation (log scale)")
    ax.set_title("What each extra costs (each model on the engine named, beam 5, 2 threads, median of 3)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "extras.png", dpi=120)
    print((out / "extras.md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()

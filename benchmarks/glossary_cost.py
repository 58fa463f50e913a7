"""What a request's glossary costs `qkv serve` in units of work: the measurements behind
``GLOSSARY_ENTRY_WORK``, ``GLOSSARY_CHARS_PER_UNIT`` and ``GLOSSARY_MATCHES_PER_UNIT`` in ``qkv.serve.batcher``.

    python -m benchmarks.glossary_cost            # a random tiny model and made-up glossaries; no data needed

Times a unit of greedy work (one decoder step of one output token, the server's unit) on the random
tiny model that the tests use, 32 texts at a time with EOS forbidden (every search runs to its limit,
as the charge assumes), and, for glossaries of short entries and of near misses (each entry shares all
but its last word with the texts: the dearest to look for), the time to compile an entry and to look
for each entry in each text (``Glossary.matches``). Prints each in units of work. One thread: set
OMP_NUM_THREADS=1 for stable numbers.
"""

from __future__ import annotations

import argparse
import time

import torch

from qkv.infer.glossary import Glossary
from qkv.infer.search import DecodeConfig, max_output_length, search
from qkv.model.config import model_preset
from qkv.model.transformer import Transformer

BOS, EOS = 1, 2
WORDS = "a man in a blue shirt is standing on a ladder cleaning windows".split()


def unit_seconds(*, texts: int, src_tokens: int, repeats: int) -> float:
    """The fastest time per unit of greedy work over ``repeats`` searches: the server charges a text
    its S source tokens (EOS included) and its output limit T, S + T units."""
    torch.manual_seed(0)
    model = Transformer(model_preset("tiny", src_vocab_size=60, tgt_vocab_size=60, pad_id=0)).eval()
    model.generator.register_forward_hook(lambda module, inputs, logits: logits.index_fill(-1, torch.tensor([EOS]), float("-inf")))
    src = torch.randint(3, 60, (texts, src_tokens))  # (B, S)
    src[:, -1] = EOS
    config = DecodeConfig(beam_size=1)
    units = texts * (src_tokens + max_output_length(model, src_tokens, config))
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        search(model, src, bos_id=BOS, eos_id=EOS, config=config)
        best = min(best, time.perf_counter() - started)
    return best / units


def glossary_seconds(entries: list[list[str]], texts: list[str]) -> tuple[float, float]:
    """Seconds to compile the glossary's patterns (with its first look) and to look for every entry in every text."""
    glossary = Glossary.from_pairs(entries)
    started = time.perf_counter()
    glossary.matches(texts[0])
    compiled = time.perf_counter() - started
    started = time.perf_counter()
    for text in texts:
        glossary.matches(text)
    return compiled, time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    unit = unit_seconds(texts=args.texts, src_tokens=50, repeats=args.repeats)
    print(f"a unit of greedy work on the random tiny model: {unit * 1e6:.0f} us ({args.texts} texts, "
          f"{torch.get_num_threads()} thread(s))")
    print(f"{'glossary':>10} {'entries':>8} {'chars':>6} {'compile us/entry':>17} {'us/char':>8} "
          f"{'look us/(entry x char)':>23} {'units/entry':>12} {'(entry x char)/unit, 2 looks':>29}")
    for n_entries, chars in [(100, 200), (500, 200), (500, 1000), (1000, 1000)]:
        texts = [" ".join(WORDS * 80)[:chars]] * args.texts
        for kind, entries in [("near-miss", [[" ".join(WORDS * 3) + f" zz{i}", f"T{i}"] for i in range(n_entries)]),
                              ("short", [[f"word{i}", f"T{i}"] for i in range(n_entries)])]:
            compiled, looked = glossary_seconds(entries, texts)
            source_chars = sum(len(e[0]) for e in entries)
            per_pair = looked / (n_entries * chars * args.texts)
            print(f"{kind:>10} {n_entries:>8} {chars:>6} {compiled / n_entries * 1e6:>17.0f} "
                  f"{compiled / source_chars * 1e6:>8.1f} {per_pair * 1e6:>23.3f} {compiled / n_entries / unit:>12.1f} "
                  f"{unit / (2 * per_pair):>29.0f}")


if __name__ == "__main__":
    main()

"""The ``qkv`` commands for documents: ``translate --format`` (its document path) and ``markup``."""

from __future__ import annotations

import argparse
import sys

from qkv.errors import QkvError
from qkv.cli.common import command, decode_config, decoding_shortlist, text_options, translator_of
from qkv.document.formats import FORMATS, check_language_tag

MARKUP_FORMATS = ("html", "markdown")  # the formats with inline markup to place on a given translation


def document_format(path: str | None) -> str | None:
    """The document format an --input file's extension names (plain .txt stays lines), or None."""
    from qkv.document.formats import format_of

    found = format_of(path)
    return None if found == "text" else found


def text_format_writer(translator, plain=None, glossary=None, glossary_always: bool = False, annotate=None):
    """For ``translate_stream``'s plain lines: input lines -> output lines, each line that holds a placeholder
    (``qkv.document.segments.PLACEHOLDER``: a URL, an e-mail address, ``{name}``, ``%s``, inline code) or a
    tab translated as ``--format text`` translates it: the placeholder kept verbatim and put back where the
    model's alignment says, each tab-separated part apart; the other lines as without it (a newcomer's
    review: the line mode wrote "https://example.com/dog" as "Comomischen Horizont", and "A dog<TAB>A cat"
    as one sentence). A line the text format refuses (beyond its bounds) is translated as a plain line,
    the others as the text format translates them. ``plain``: lines -> translations for the other lines
    (None: ``translator.translate``); ``glossary``: the terms the marked lines' translations must hold,
    as ``--format text --glossary`` puts them (with ``plain`` the glossary's writer for the others);
    ``annotate``: ``qkv.cli.trust.annotator``'s, each marked line written with the confidence of what the
    model read and wrote (its least confident part's), as ``plain`` writes the others."""
    from qkv.document.formats import read
    from qkv.document.segments import PLACEHOLDER
    from qkv.document.translate import translate_segments

    translate_plain = plain or translator.translate

    def as_document(line: str):  # the line as the text format reads it; None beyond its bounds (words, markup, bytes)
        try:
            return read(line + "\n", "text")
        except QkvError:
            return None

    def write(lines: list[str]) -> list[str]:
        documents = {i: as_document(line) for i, line in enumerate(lines) if "\t" in line or PLACEHOLDER.search(line)}
        documents = {i: document for i, document in documents.items() if document is not None}
        unmarked = [i for i in range(len(lines)) if i not in documents]
        out = [""] * len(lines)
        for i, text in zip(unmarked, translate_plain([lines[i] for i in unmarked]) if unmarked else []):
            out[i] = text
        # every marked line's segments in one batch, each line written back by its own document
        trust = {} if annotate is None else {"confidence": True, "calibration": annotate.calibration,
                                             "model": annotate.model, "words": annotate.words}
        placed, reports = translate_segments(translator, [s for document in documents.values() for s in document.segments],
                                             glossary=glossary, glossary_always=glossary_always, **trust)
        at = 0
        for i, document in documents.items():
            n = len(document.segments)
            text = document.write(placed[at : at + n]).removesuffix("\n")
            if annotate is not None:  # its least confident part's verdict; nothing the model read: an empty line's
                judged = [r.trust for r in reports[at : at + n] if r.trust is not None]
                text = (annotate.format(text, min(judged, key=lambda t: t.confidence)) if judged
                        else annotate([[""]], [[""]], [text])[0])
            out[i] = text
            at += n
        return [" ".join(text.splitlines()) for text in out]  # never more than one output line per input line

    return write


def check_document_args(args: argparse.Namespace) -> None:
    """What a document cannot be translated with, refused before anything loads."""
    for flag, given in (("--n-best", args.n_best > 1), ("--sampling", args.sampling), ("--trace", args.trace),
                        ("--glossary-report", args.glossary_report), ("--progress", args.progress)):
        if given:
            raise QkvError(f"{flag} goes with lines of plain text, not with a document (--format)")
    if getattr(args, "lang", None) is not None:  # refused here, before anything loads
        check_language_tag(args.lang, "--lang")


def read_document(path: str | None) -> str:
    """A whole document, from a file or stdin, as UTF-8 text (a one-line error where it is not, or where
    it is longer than ``MAX_BYTES`` characters: read no further than that)."""
    from qkv.document.formats import MAX_BYTES

    limit = 4 * MAX_BYTES + 1  # UTF-8 writes a character in at most 4 bytes
    if path:
        with open(path, "rb") as handle:
            raw = handle.read(limit)
    else:
        raw = getattr(sys.stdin, "buffer", sys.stdin).read(limit)
    if len(raw) >= limit:
        raise QkvError(f"{path or 'standard input'}: qkv translates documents of up to {MAX_BYTES:,} characters (split it)")
    if isinstance(raw, str):
        text = raw
    else:
        try:
            text = raw.decode("utf-8")  # a byte order mark is kept for the reader: it comes back in the output
        except UnicodeDecodeError as error:
            line = raw[: error.start].count(b"\n") + 1
            raise QkvError(f"{path or 'standard input'}, line {line}: not UTF-8 text (byte {error.start})") from None
    return text


def read_input_document(args: argparse.Namespace, format: str):
    """The --input document (or stdin's) read as ``format``, with the target language it is to say: done
    before any model loads, so that a broken document costs nothing."""
    from qkv.io import checkpoint
    from qkv.document.formats import read

    text, lang = read_document(args.input), args.lang
    if lang is None:
        try:  # a checkpoint that cannot be read is reported when the model loads, after the document
            lang = (checkpoint.read_config(args.checkpoint[0]).get("data") or {}).get("tgt_lang")
        except QkvError:
            lang = None
    return read(text, format, target_lang=lang)


def translate_document_command(args: argparse.Namespace, document, model, tokenizer, glossary, inputs, reads) -> int:
    """``qkv translate --format F``: the whole input translated as one document, written whole (to -o only
    once it is done: nothing is written on failure). With --confidence, a line per segment on stderr:
    where it is, its confidence and flags."""
    import json

    from qkv.io.outputs import output_or_stdout
    from qkv.cli.trust import trust_model
    from qkv.document.translate import translate_read

    own, _, calibration = trust_model(args, model, tokenizer, notice=bool(args.confidence))
    translator = translator_of(args, model, tokenizer, decode_config(args), max_tokens=args.batch_tokens,
                               workers=args.workers, shortlist=decoding_shortlist(args, model), text=text_options(args))
    with translator:
        result = translate_read(translator, document, glossary=glossary, glossary_always=args.glossary_always,
                                confidence=bool(args.confidence), calibration=calibration, model=own)
    with output_or_stdout(args.output, force=args.force, inputs=inputs, reads=reads) as sink:
        sink.write(result.text)
    if args.confidence:
        for report in result.segments:
            if args.confidence == "json":
                print(json.dumps(report.as_dict(), ensure_ascii=False), file=sys.stderr)
            else:
                confidence = "-" if report.confidence is None else f"{report.confidence:.3f}"  # nothing to translate
                print(f"{report.where}\t{confidence}\t{','.join(report.flags) or '-'}", file=sys.stderr)
    return 0


def _markup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or a run directory: uses its final/) whose alignment places the markup")
    p.add_argument("--format", choices=MARKUP_FORMATS, help="the documents' format (default: from --source's extension)")
    p.add_argument("--source", required=True, help="the source document, with its markup")
    p.add_argument("--input", "-i", help="its translation, the same blocks without inline markup (default: stdin)")
    p.add_argument("--output", "-o", help="write the translation with the markup placed here (default: stdout)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --output file that qkv wrote")


@command("markup", "put a source document's inline markup onto a translation of it (a human one, a post-edit)", _markup_args)
def markup(args: argparse.Namespace) -> int:
    from qkv.io import checkpoint
    from qkv.io.outputs import check_output, output_or_stdout, read_dirs
    from qkv.document.formats import format_of
    from qkv.document.translate import place_read_markup, read_markup_pair

    inputs, reads = (args.source, args.input), read_dirs([args.checkpoint])
    if args.output:
        check_output(args.output, force=args.force, inputs=inputs, reads=reads)
    format = args.format or format_of(args.source)
    if format is None:
        raise QkvError(f"{args.source}: give --format (the extension names no format qkv knows)")
    if format not in MARKUP_FORMATS:
        raise QkvError(f"a {format} document has no inline markup to place: qkv markup takes html or markdown "
                       "(translate the others with qkv translate --format)")
    pair = read_markup_pair(read_document(args.source), read_document(args.input), format)  # before the model loads
    loaded = checkpoint.load(args.checkpoint)
    text = place_read_markup(loaded.model, loaded.tokenizer, *pair)
    with output_or_stdout(args.output, force=args.force, inputs=inputs, reads=reads) as sink:
        sink.write(text)
    return 0

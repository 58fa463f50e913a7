"""qkv translate's notice when most translations are empty (what an undertrained model writes): counted
on what the command writes, against the input lines that had something to translate."""

from __future__ import annotations

import io

from qkv.cli.decode import _EmptyCount


def _run(inputs: list[bytes], outputs: list[str]) -> tuple[str | None, str]:
    sink = io.StringIO()
    counted = _EmptyCount(sink)
    assert list(counted.inputs(inputs)) == inputs  # the source passes through unchanged
    counted.writelines(line + "\n" for line in outputs[:1])
    for line in outputs[1:]:
        counted.write(line + "\n")
    return counted.notice(), sink.getvalue()


def test_most_translations_empty_gives_one_notice_and_blank_input_lines_do_not_count():
    notice, written = _run([b"a man\n", b"\n", b"two dogs\n", b"a cat\n"], ["", "", "", "un chat"])
    assert written == "\n\n\nun chat\n"  # what is written is unchanged
    assert notice == ("note: 2 of 3 translations are empty: the model most likely has not been trained enough "
                      "(a run of a few dozen updates writes nothing); train it longer, or check --checkpoint")
    assert _run([b"a man\n", b"two dogs\n", b"a cat\n"], ["un homme", "", "un chat"])[0] is None  # one of three
    assert _run([b"\n", b" \n"], ["", ""])[0] is None  # nothing to translate, nothing to say
    assert _run([b"a man\n", b"a cat\n"], ["\t0.412\tomission", "\t0.300\t"])[0].startswith("note: 2 of 2")  # --confidence columns

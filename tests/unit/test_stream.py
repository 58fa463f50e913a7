"""``translate_stream`` (``qkv translate``'s loop): how it cuts its input into batches, and its order."""

import io

from qkv.infer import translator
from qkv.infer.translator import Translation, translate_stream


class Recorder:
    """Stands in for a Translator: records the lines of each call and echoes them upper-cased."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def translate_nbest(self, lines: list[str]) -> list[list[Translation]]:
        self.calls.append(len(lines))
        return [[Translation(line.upper(), [], 0.0)] for line in lines]


class Terminal(io.BytesIO):
    def isatty(self) -> bool:
        return True


def test_a_file_is_translated_stream_lines_at_a_time_in_order():
    lines = [f"line {i}" for i in range(2 * translator.STREAM_LINES + 5)]
    recorder, out = Recorder(), io.StringIO()
    translate_stream(recorder, io.BytesIO("".join(f"{line}\n" for line in lines).encode()), out, name="in")
    assert translator.STREAM_LINES == 1024  # what the docstring and docs/benchmarks.md (c) say
    assert recorder.calls == [1024, 1024, 5]
    assert out.getvalue().splitlines() == [line.upper() for line in lines]


def test_a_terminal_is_answered_line_by_line():
    recorder, out = Recorder(), io.StringIO()
    translate_stream(recorder, Terminal(b"a\nb\nc\n"), out, name="stdin")
    assert recorder.calls == [1, 1, 1] and out.getvalue() == "A\nB\nC\n"

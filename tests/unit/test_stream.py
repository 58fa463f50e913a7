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


def test_progress_hears_of_every_line_once_each_batch_is_written():
    lines = [f"line {i}" for i in range(translator.STREAM_LINES + 5)]
    done, out = [], io.StringIO()

    def progress(n: int) -> None:
        done.append((n, out.getvalue().count("\n")))  # what the sink holds when it is told

    translate_stream(Recorder(), io.BytesIO("".join(f"{line}\n" for line in lines).encode()), out, name="in", progress=progress)
    assert done == [(1024, 1024), (5, 1029)]


def test_qkv_translate_progress_counts_the_input_file_and_prints_a_line_on_stderr(tmp_path, capsys):
    import argparse

    from qkv.cli.common import line_progress, progress_arg

    parser = argparse.ArgumentParser()
    progress_arg(parser)
    source = tmp_path / "in.txt"
    source.write_bytes(b"a\nb\n\nc")  # four lines, the last without its "\n"
    args = parser.parse_args(["--progress"])
    args.input = str(source)
    with line_progress(args) as advance, open(source, "rb") as lines:
        translate_stream(Recorder(), lines, io.StringIO(), name="in", progress=advance)
    assert "line 4/4 (100%)" in capsys.readouterr().err  # not a terminal here: the plain line, at the end
    for flags in (["--no-progress"], []):  # asked not to, and by default where stderr is not a terminal (pytest's)
        args = parser.parse_args(flags)
        args.input = str(source)
        with line_progress(args) as advance:
            assert advance is None
    assert capsys.readouterr().err == ""

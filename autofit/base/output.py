"""stdout is autofit's answer alone: `autofit tune`'s profile path (which scripts capture
with `$(autofit tune ...)`) or a command's JSON. Whatever else is written there while a
command runs goes to stderr: a user's model printing its parameter count (nanoGPT does),
a library's banner, a C extension writing to file descriptor 1, a child process that
inherited it.

    with reserved_stdout():
        run_the_command()          # print(...) and os.write(1, ...) land on stderr
        answer(json.dumps(out))    # the one thing on stdout
"""

import contextlib
import io
import os
import sys

_answer_stream = None  # where `answer` writes while a command runs; None: sys.stdout


def answer(text: str) -> None:
    """Print `text` (a line) as the command's answer on stdout."""
    stream = _answer_stream if _answer_stream is not None else sys.stdout
    stream.write(text + "\n")
    stream.flush()


@contextlib.contextmanager
def reserved_stdout():
    """Inside: sys.stdout is sys.stderr, and file descriptor 1 (which child processes and C
    code write to) points where fd 2 does; `answer` writes to the real stdout. Where
    stdout is no file (a test's capture), only sys.stdout is moved."""
    global _answer_stream
    previous_stream, previous_stdout = _answer_stream, sys.stdout
    real = previous_stdout
    saved_fd = None
    try:
        fd, err_fd = previous_stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        fd = err_fd = None
    if fd is not None and err_fd is not None and fd != err_fd:
        previous_stdout.flush()
        saved_fd = os.dup(fd)
        os.dup2(err_fd, fd)
        real = open(saved_fd, "w", encoding=getattr(previous_stdout, "encoding", None) or "utf-8",
                    errors=getattr(previous_stdout, "errors", None) or "strict", closefd=False)
    _answer_stream, sys.stdout = real, sys.stderr
    try:
        yield
    finally:
        sys.stdout, _answer_stream = previous_stdout, previous_stream
        if saved_fd is not None:
            try:
                real.flush()
            except (BrokenPipeError, ValueError):
                pass
            sys.stderr.flush()
            os.dup2(saved_fd, fd)
            os.close(saved_fd)

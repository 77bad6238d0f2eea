"""The terminal dspatch's commands print to: its width, lines wrapped to it, and colour where it shows.

Standard library only and no `re`, `shutil` or `textwrap`: `dspatch check` prints through this, and a warm check
costs a few milliseconds in all.
"""
import os
import sys

UNWRAPPED = 10 ** 6  # piped output, COLUMNS unset: one record a line, for grep and scripts (as git has it)


def width(stream=None):
    """Columns to fit: COLUMNS when set (as shutil reads it), else the terminal's; output that goes to no terminal is
    not wrapped."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
        if columns > 0:
            return max(columns, 40)
    except ValueError:
        pass
    try:
        return max(os.get_terminal_size((stream or sys.stdout).fileno()).columns, 40)
    except (OSError, ValueError, AttributeError):
        return UNWRAPPED


def wrap(text, columns, first="", rest=None):
    """`text` in lines of at most `columns` characters, the first after `first`, the others after `rest` (default:
    as many spaces as `first` is long). A word longer than a line is cut, never left to overflow."""
    rest = " " * len(first) if rest is None else rest
    lines, line, lead = [], first, first
    for word in text.split():
        while True:
            gap = "" if line == lead else " "
            if len(line) + len(gap) + len(word) <= columns:
                line += gap + word
                break
            if line != lead:  # the line holds words: end it, the word starts the next one
                lines.append(line)
                line = lead = rest
                continue
            room = max(columns - len(line), 1)  # a word alone wider than the line: cut it where it must be
            lines.append(line + word[:room])
            word = word[room:]
            line = lead = rest
            if not word:
                break
    if line != lead or not lines:
        lines.append(line)
    return lines


def fit(line, columns):
    """One printed line wrapped to `columns`, its continuation indented two more than the line itself."""
    if len(line) <= columns:
        return [line]
    indent = len(line) - len(line.lstrip(" "))
    return wrap(line.strip(), columns, " " * indent, " " * (indent + 2))


def out(lines, stream=None):
    """Print `lines`, each fitted to the terminal's width."""
    stream = stream or sys.stdout
    columns = width(stream)
    for line in lines:
        for piece in fit(line, columns):
            stream.write(piece + "\n")


_CODES = {"green": "32", "yellow": "33", "red": "31", "dim": "2", "bold": "1"}


def colours(stream=None):
    """Whether to colour: a terminal that shows it, NO_COLOR unset (no-color.org), TERM not dumb."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def paint(text, colour, on):
    return f"\033[{_CODES[colour]}m{text}\033[0m" if on and colour in _CODES else text


def exit_with(call):
    """End the process with `call()`'s status, as command-line tools do: quietly when the output is piped into a
    reader that stopped (`dspatch check | head`), 130 when interrupted."""
    try:
        code = call()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    except KeyboardInterrupt:
        print("dspatch: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)

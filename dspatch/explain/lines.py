"""Reading a log's lines as `explain` matches them: colour codes, progress redraws and launcher prefixes taken off,
a debugger's two-line exceptions and wrapped messages joined, the window around a message, the versions a log prints."""
import re

# ESC [ ... final byte, and other two-character escapes
ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
# launcher prefixes: torchrun --tee/--role ([default0]:), torch's elastic logs ([rank1]:), deepspeed's launcher
# ("0: ", "rank0: "), slurm --label ("0: "); applied repeatedly ("[rank1]:[rank1]: " happens)
_PREFIX = re.compile(r"^\s*(?:\[(?:rank|default|worker)?\d+\]:|(?:rank)?\d{1,4}:(?=\s))\s?")
# what a log line is cut to before matching (very long lines are tensor dumps, not error messages)
_LINE_LIMIT = 4000
# VS Code's and PyCharm's way of showing an exception: its class on one line, the message on the next
_DEBUGGER = re.compile(r"^\s*Exception has occurred:\s*([\w.]+)\s*$")
_TRACEBACK = "Traceback (most recent call last)"
_FRAME = re.compile(r'^\s*File "')
# the class name (qualified or not) and colon that end the text before a message
_ERROR_BEFORE = re.compile(r"(?:^|[^\w.])(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*):$")
# a message pasted alone: nothing before it but quoting and list punctuation
_BARE = re.compile(r"^[\s`'\">*#|:-]*$")
# versions a log prints: pip freeze/list, `transformers-cli env` / `trl env`, ds_report, DeepSpeed's banner and
# zero_to_fp32's "created by deepspeed==X"
_VERSION = re.compile(r"(?i)(?:^|[^\w/.-])(deepspeed|transformers|accelerate|trl|peft|torch)(?![\w/-])[`'\"]?"
                      r"(?:\s*(?:info|version)\b)?(?:\s*:\s*|\s*==\s*|\s*=\s*|\s+|\s*\.{2,}\s*)"
                      r"v?(\d+\.\d+\.\d+(?:[.+-]?(?:dev|rc|post|a|b)\d*)?)(?![\d.]*\w)")
_DEEPSPEED_BANNER = re.compile(r"DeepSpeed info: version=(\d+\.\d+\.\d+[\w.+]*)")
# how far around a message its evidence may be, when no `Traceback` line bounds it
LINES_BEFORE, LINES_AFTER = 80, 40
JOINED = 2  # continuation lines a wrapped message may take


def clean_line(line):
    """One line as a reader sees it: no colour codes, no progress redraws, no rank prefixes."""
    line = ANSI.sub("", line)
    if "\r" in line:  # a progress bar redrawn in place: what remains on screen is the last segment
        line = ([part for part in line.split("\r") if part.strip()][-1:] or [""])[0]
    for _ in range(3):
        stripped = _PREFIX.sub("", line, count=1)
        if stripped == line:
            break
        line = stripped
    return line[:_LINE_LIMIT].rstrip()


def clean_lines(text):
    """The log's lines as a reader sees them (see clean_line); a debugger's `Exception has occurred: X` line reads
    `X: <the message on the next line>`."""
    # "\n" only: str.splitlines() would also split at the "\r" of a progress redraw
    raw = text.split("\n")
    if raw and raw[-1] == "":
        raw.pop()
    lines = [clean_line(line) for line in raw]
    join_debugger_lines(lines, range(len(lines) - 1))
    return lines


def join_debugger_lines(lines, numbers):
    for number in numbers:
        debugger = _DEBUGGER.match(lines[number])
        if debugger:
            lines[number] = f"{debugger.group(1)}: {lines[number + 1].strip()}"


class Sparse:
    """A long log's lines of which only those that can matter were read (see skim): the others read as empty
    lines, which no signature, version or traceback pattern matches. Indexed and sliced as a list."""

    def __init__(self, count, kept):
        self.count = count
        self.kept = kept
        self.numbers = sorted(kept)

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.kept.get(n, "") for n in range(*index.indices(self.count))]
        return self.kept.get(index + self.count if index < 0 else index, "")

    def __setitem__(self, index, value):
        self.kept[index] = value


def present_lines(lines, where=None):
    """The numbers of `where` (default: every line) that can hold text: all of them, or those a Sparse kept."""
    where = range(len(lines)) if where is None else where
    if not isinstance(lines, Sparse):
        return where
    import bisect

    numbers = lines.numbers
    return numbers[bisect.bisect_left(numbers, where.start):bisect.bisect_left(numbers, where.stop)]


def _variants(lines, number):
    """The text at line `number`, then that line joined with the next ones (a message wrapped by a terminal or
    by hand, or put under an empty `SomeError:` line), as long as they are not frames or a new traceback."""
    text = lines[number]
    yield text
    if _FRAME.match(text):
        return
    for following in lines[number + 1:number + 1 + JOINED]:
        part = following.strip()
        if not part or _FRAME.match(following) or _TRACEBACK in following:
            return
        yield text + part  # cut inside a word
        text = text + " " + part
        yield text


def _error_fits(before, error):
    """Whether the text before a message fits the exception class `error` (None: anything does)."""
    if error is None or _BARE.match(before):
        return True
    found = _ERROR_BEFORE.search(before.rstrip())
    return bool(found) and found.group(1) in error.split("|")


def message_at(lines, number, signature):
    """The text at `number` in which the signature's message (of its exception) is, or None."""
    pattern = re.compile(signature.message)
    for text in _variants(lines, number):
        # a message that starts on a later line is found there
        for found in pattern.finditer(text):
            if found.start() < len(lines[number]) and _error_fits(text[:found.start()], signature.error):
                return text
    return None


def traceback_window(lines, number):
    """Line numbers (0-based, a range) of the traceback around the message at `number`: from its `Traceback`
    line (or LINES_BEFORE lines up) to the next traceback (or LINES_AFTER lines down)."""
    start = max(0, number - LINES_BEFORE)
    for back in range(number, max(-1, number - 4 * LINES_BEFORE), -1):
        if _TRACEBACK in lines[back]:
            start = back
            break
    end = min(len(lines), number + LINES_AFTER + 1)
    for ahead in range(number + 1, end):
        if _TRACEBACK in lines[ahead]:
            end = ahead
            break
    return range(start, end)


def first_match(lines, where, pattern):
    found = pattern if callable(pattern) else re.compile(pattern).search
    return next((n for n in present_lines(lines, where) if found(lines[n])), None)


def log_versions(lines):
    """{distribution: version} printed in the log, for those it prints one version of."""
    seen = {}
    for number in present_lines(lines):
        line = lines[number]
        for name, version in _VERSION.findall(line):
            seen.setdefault(name.lower(), {}).setdefault(version, number)
        for version in _DEEPSPEED_BANNER.findall(line):
            seen.setdefault("deepspeed", {}).setdefault(version, number)
    return {name: (next(iter(found)), next(iter(found.values())) + 1)
            for name, found in seen.items() if len(found) == 1}

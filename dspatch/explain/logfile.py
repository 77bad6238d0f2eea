"""Reading a log of any size: two skims for a few fixed words, then only the lines around what they found."""
import os
import re
import shutil
import sys

from dspatch.explain.lines import LINES_AFTER, ANSI, LINES_BEFORE, JOINED, Sparse, clean_line, join_debugger_lines, clean_lines
from dspatch.explain.patterns import signature_plan

_CHUNK = 16 << 20  # bytes read at a time: memory stays a few chunks whatever the log's size


def _message_lines(chunk, first, word, uses):
    """Line numbers of the chunk where a message of `uses` may start: a line that holds `word`, or one of the
    JOINED lines above it, when those lines also hold two words of one of its fixed texts (all, if it has one)."""
    found = set()
    at = chunk.find(word)
    while at >= 0:
        start = chunk.rfind(b"\n", 0, at) + 1
        for _ in range(JOINED):
            start = chunk.rfind(b"\n", 0, max(start - 1, 0)) + 1 if start else 0
        end = at
        for _ in range(JOINED + 1):
            end = chunk.find(b"\n", end + 1)
            if end < 0:
                end = len(chunk)
                break
        near = chunk[start:end]
        if any(sum(w.encode() in near for w in words) >= min(2, len(words))
               for _, _, alternatives in uses for words in alternatives):
            found.add(start)
        at = chunk.find(word, chunk.find(b"\n", at) + 1 or len(chunk))
    return {n + k for n in _numbered(chunk, first, found) for k in range(JOINED + 1)}


def _spans(f, size):
    """(first line number, lines, (offset, end, whether colour codes are in it)) of the log's first `size` bytes, in
    chunks: _CHUNK bytes or so of whole lines at a time (the last line may lack its newline), read once to count
    lines."""
    line, offset = 0, 0
    f.seek(0)
    while offset < size:
        block = f.read(min(_CHUNK, size - offset))
        if not block:
            return
        if not block.endswith(b"\n") and offset + len(block) < size:
            block += f.readline(size - offset - len(block))  # the rest of its last line
        lines = block.count(b"\n") + (not block.endswith(b"\n"))
        yield line, lines, (offset, offset + len(block), b"\x1b" in block)
        line += lines
        offset += len(block)


def _read(f, span):
    """The chunk at `span`, colour codes taken out (they may sit inside a word)."""
    f.seek(span[0])
    return _strip_ansi(f.read(span[1] - span[0]))


_GREP = shutil.which("grep") if os.name == "posix" else None


def _hidden(found, words):
    """The words that an occurrence of `found`, as `grep -o` reports it, may hide: itself, those inside it, and those
    that start inside it (grep goes on from where a match ends, and reports the longest of those that start at one
    place)."""
    return {w for w in words if w in found or any(w.startswith(found[i:]) for i in range(len(found)) if found[i] == w[0])}


def _name_found(match):
    """The package name a match of the names' pattern holds, lowercased (the character after it left out)."""
    return (match if match[-1:].isalpha() else match[:-1]).lower()


class _Grep:
    """`grep -b -o` (bytes, C locale) for `words` over the log's file, run in the background while Python reads the
    log: where each of them is (fixed strings; or package names, lowercase letters, where a version may follow).
    One pass in C, where Python's own search goes over the log once per word."""

    def __init__(self, f, words, names=False):
        import subprocess
        import tempfile

        self.proc, self.found, self.fold = None, None, _name_found if names else bytes
        self.words, self.hidden = {self.fold(w) for w in words}, {}
        path = getattr(f, "name", None)
        if not _GREP or not words or not isinstance(path, str) or not os.path.isfile(path) or \
                os.path.getsize(path) != f.seek(0, os.SEEK_END):
            return  # not a plain file read whole (a decoded copy, say): Python searches each chunk
        try:
            self.out = tempfile.TemporaryFile()  # not a pipe: grep never waits for Python to read what it found
            # names: any case, then a character that is no part of a word or a path (_VERSION's condition, widened)
            pattern = b"(" + b"|".join(sorted(words)) + b")([^A-Za-z0-9_/-]|$)" if names else b"\n".join(sorted(words))
            env = {k: v for k, v in os.environ.items() if not k.startswith("GREP_")}  # no GREP_OPTIONS, colours
            self.proc = subprocess.Popen([_GREP, "-a", "-b", "-o", "--color=never", *(["-E", "-i"] if names else ["-F"]),
                                          "-f", "-", path], stdin=subprocess.PIPE, stdout=self.out,
                                         stderr=subprocess.DEVNULL, env={**env, "LC_ALL": "C"})
            self.proc.stdin.write(pattern)
            self.proc.stdin.close()
        except OSError:
            self.close()

    def _matches(self):
        """(sorted offsets, the words found there) once grep is done, or None when it cannot tell (an error)."""
        if self.found is None and self.proc is not None and self.proc.wait() in (0, 1):
            self.out.seek(0)
            try:
                pairs = sorted((int(at), self.fold(word)) for at, _, word in
                               (line.partition(b":") for line in self.out.read().splitlines()))
            except ValueError:  # not grep's `offset:match` lines: it cannot tell
                self.proc = None
                return None
            self.found = [at for at, _ in pairs], [word for _, word in pairs]
        return self.found

    def words_in(self, span, among):
        """The words of `among` that may be in the chunk at `span` (offset, end, colour codes in it): those grep
        found there or that a match found there may hide; all of them where grep cannot tell, or where colour
        codes are in the chunk (grep read the raw bytes, where a code may sit inside a word)."""
        import bisect

        found = self._matches()
        if found is None or span[2]:
            return set(among)
        offsets, words = found
        near = set(words[bisect.bisect_left(offsets, span[0]):bisect.bisect_left(offsets, span[1])])
        for word in near - self.hidden.keys():
            self.hidden[word] = _hidden(word, self.words)
        possible = set().union(*(self.hidden[word] for word in near))
        return {w for w in among if self.fold(w) in possible}

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if hasattr(self, "out"):
            self.out.close()
        self.proc = None


_ANSI_BYTES = re.compile(ANSI.pattern.encode())  # the same codes, in the raw bytes


def _strip_ansi(data):
    return _ANSI_BYTES.sub(b"", data) if b"\x1b" in data else data


def _lines_holding(chunk, first, texts, search=None):
    """{line number: offset of its start} of the chunk's lines that hold any of `texts` (bytes), by plain search
    (in `search`, a same-length copy of the chunk, when given: the chunk lowercased, say)."""
    search = chunk if search is None else search
    starts = set()
    for text in texts:
        at = search.find(text)
        while at >= 0:
            starts.add(search.rfind(b"\n", 0, at) + 1)
            at = search.find(text, search.find(b"\n", at) + 1 or len(search))
    return _numbered(chunk, first, starts)


def _numbered(chunk, first, starts):
    """{line number: offset} of line starts in the chunk (whose first line is number `first`)."""
    found, counted, line = {}, 0, first
    for start in sorted(starts):
        line += chunk.count(b"\n", counted, start)
        counted = start
        found[line] = start
    return found


def _line_start(chunk, index):
    """Offset in the chunk of the start of its line `index` (0-based): a binary search on newline counts."""
    low, high, below = 0, len(chunk), 0  # below: the newlines before `low` (each step counts only its window)
    while low < high:
        middle = (low + high) // 2
        counted = below + chunk.count(b"\n", low, middle)
        if counted < index:
            low, below = middle + 1, counted + (chunk[middle:middle + 1] == b"\n")
        else:
            high = middle
    return low


def _read_lines(chunk, first, starts, runs, into):
    """Clean into `into` {number: line}: the lines at `starts` {number: offset}, and the runs (first number, last
    number + 1) of consecutive lines, found from their numbers."""
    def read(number, start):
        end = chunk.find(b"\n", start)
        into[number] = clean_line((chunk[start:] if end < 0 else chunk[start:end]).decode("utf-8", errors="replace"))
        return len(chunk) if end < 0 else end + 1

    for number, start in starts.items():
        read(number, start)
    for low, high in runs:
        start = _line_start(chunk, low - first)
        for number in range(low, high):
            if start >= len(chunk):
                break
            start = read(number, start)


def _runs(numbers):
    """Sorted numbers as runs of consecutive ones: [(first, last + 1)]."""
    runs = []
    for n in sorted(numbers):
        if runs and runs[-1][1] == n:
            runs[-1][1] = n + 1
        else:
            runs.append([n, n + 1])
    return runs


def skim(f, patches):
    """The log in the open binary file `f` (seekable) as a Sparse list of lines: the lines around every place a known
    bug's message may be, the lines the log-wide patterns of those bugs may match, and the lines that may print the
    versions they depend on. Memory stays a few chunks. Two greps run at once, beside Python's count of the lines:
    one for the messages' words and every fixed text of the log-wide patterns, one for the packages' names (any
    case); Python then searches only the chunks where they found something (all of them where there is no grep),
    for what they found there."""
    plan = signature_plan(patches)
    if plan is None:  # a pattern with no fixed text: every line is read
        f.seek(0)
        return clean_lines(f.read().decode("utf-8", errors="replace"))
    triggers, anywhere = plan
    fixed = {w.encode() for w in triggers} | {t.encode() for texts in anywhere.values() for t in texts}
    names = {n.lower().encode() for patch in patches for n in (patch.distribution, *patch.requires)}
    size = f.seek(0, os.SEEK_END)  # what grep reads: lines a job appends meanwhile are for the next reading
    greps = []
    try:
        greps.append(_Grep(f, fixed))
        greps.append(_Grep(f, names, names=True))
        return _skimmed(f, triggers, anywhere, *greps, size)
    finally:
        for grep in greps:
            grep.close()


def _skimmed(f, triggers, anywhere, fixed, named, size):
    import bisect

    spans = list(_spans(f, size))
    count = spans[-1][0] + spans[-1][1] if spans else 0
    hits, found = set(), set()
    for first, _, span in spans:
        words = fixed.words_in(span, (w.encode() for w in triggers))
        chunk = _read(f, span) if words else b""
        for word in words:
            at = _message_lines(chunk, first, word, triggers[word.decode()])
            if at:
                hits |= at
                found.add(word.decode())
    if not hits:
        return Sparse(count, {})
    # a message's traceback reaches 4 * LINES_BEFORE lines up, its wrapped lines JOINED down
    around = set()
    for n in hits:
        around.update(range(max(0, n - 4 * LINES_BEFORE - JOINED), min(count, n + LINES_AFTER + JOINED + 1)))
    around = sorted(around)
    candidates = [use for word in found for use in triggers[word]]
    texts = {t.encode() for _, signature, _ in candidates for t in anywhere[signature]}
    # the versions that can decide between them: those of their packages (and what their bugs also need)
    names = {n.lower().encode() for patch, _, _ in candidates for n in (patch.distribution, *patch.requires)}
    kept = {}
    for first, lines, span in spans:
        runs = _runs(around[bisect.bisect_left(around, first):bisect.bisect_left(around, first + lines)])
        with_texts, with_names = fixed.words_in(span, texts), named.words_in(span, names)
        if runs or with_texts or with_names:
            chunk = _read(f, span)
            starts = _lines_holding(chunk, first, with_texts)
            if with_names:
                starts.update(_lines_holding(chunk, first, with_names, search=chunk.lower()))
            _read_lines(chunk, first, starts, runs, kept)
    lines = Sparse(count, kept)
    join_debugger_lines(lines, [n for n in lines.numbers if n + 1 < count])
    return lines


class Unreadable(ValueError):
    pass


def open_log(source):
    """A seekable binary file of the log's UTF-8 text: the file itself, or a temporary copy of what needed decoding
    (gzip, UTF-16 with its byte-order mark) or could not be read twice (standard input). Unreadable: not text."""
    import tempfile

    raw = sys.stdin.buffer if source == "-" else open(source, "rb")
    head = raw.peek(4)[:4] if hasattr(raw, "peek") else b""
    stream, decode = raw, None
    if head[:2] == b"\x1f\x8b":
        import gzip

        stream = gzip.GzipFile(fileobj=raw)
        head = stream.peek(4)[:4]
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        import codecs

        decode = codecs.getincrementaldecoder("utf-16")(errors="replace")
    if stream is raw and decode is None and source != "-":
        copy = raw
    else:
        copy = tempfile.TemporaryFile()
        while True:
            block = stream.read(_CHUNK)
            if not block:
                break
            copy.write(decode.decode(block).encode("utf-8") if decode else block)
        if decode:
            copy.write(decode.decode(b"", final=True).encode("utf-8"))
        copy.seek(0)
    sample = copy.read(1 << 16)
    copy.seek(0)
    if b"\x00" in sample:
        copy.close()
        raise Unreadable("it is not text (it holds NUL bytes; logs are read as UTF-8, UTF-16 with its byte-order "
                         "mark, or gzip of either)")
    return copy


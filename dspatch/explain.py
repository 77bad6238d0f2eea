"""Name the known bugs a failed job's log shows, and say what to do about each here.

    dspatch explain job.log            (or python -m dspatch.explain job.log; job.log.gz, UTF-16 logs too)
    some-command 2>&1 | dspatch explain -

Each patch declares how its bug shows in a log (`Patch.signatures`, dspatch.spec.Signature): the message, the
exception it belongs to, and the frames or lines that tell it from other failures with the same words. The log is
only read: nothing in it is executed or imported. Before matching, each line loses ANSI colour codes,
carriage-return progress redraws (tqdm keeps the last one) and launcher prefixes such as `[rank1]:`, `[default0]:`
or `rank0: `; a debugger's `Exception has occurred: X` is read with the message under it, and a message wrapped
over lines (or under an empty `SomeError:` line) is read joined.

A wrong name sends a user to a fix for a bug they do not have, so a name is given only when the log decides it:
where two known bugs give the same message and the log's frames and versions cannot tell them apart, both are
listed as candidates, with what to look at, and neither is asserted; so is a bug whose lines a failure that no
patch fixes also writes, unless a line of the log points to the bug. Each verdict says how sure it is and why:
the line that matched, the lines that decided, and the versions taken into account (printed in the log, or, to
choose between candidates only, those of this environment).

A message whose bug the versions installed here do not have (the log printing none) is set aside, said as such:
if the log came from another machine, its versions there decide.

Exit status: 0 when a known bug (a choice of two, or one set aside) was found, 1 when none was (the log says so),
2 when the log cannot be read.
"""
import argparse
import functools
import json
import os
import re
import shutil
import sys

# ESC [ ... final byte, and other two-character escapes
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
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
_BEFORE, _AFTER = 80, 40
_JOINED = 2  # continuation lines a wrapped message may take


def _clean(line):
    """One line as a reader sees it: no colour codes, no progress redraws, no rank prefixes."""
    line = _ANSI.sub("", line)
    if "\r" in line:  # a progress bar redrawn in place: what remains on screen is the last segment
        line = ([part for part in line.split("\r") if part.strip()][-1:] or [""])[0]
    for _ in range(3):
        stripped = _PREFIX.sub("", line, count=1)
        if stripped == line:
            break
        line = stripped
    return line[:_LINE_LIMIT].rstrip()


def clean_lines(text):
    """The log's lines as a reader sees them (see _clean); a debugger's `Exception has occurred: X` line reads
    `X: <the message on the next line>`."""
    # "\n" only: str.splitlines() would also split at the "\r" of a progress redraw
    raw = text.split("\n")
    if raw and raw[-1] == "":
        raw.pop()
    lines = [_clean(line) for line in raw]
    _join_debugger_lines(lines, range(len(lines) - 1))
    return lines


def _join_debugger_lines(lines, numbers):
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


def _present(lines, where=None):
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
    for following in lines[number + 1:number + 1 + _JOINED]:
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


def _message_at(lines, number, signature):
    """The text at `number` in which the signature's message (of its exception) is, or None."""
    pattern = re.compile(signature.message)
    for text in _variants(lines, number):
        # a message that starts on a later line is found there
        for found in pattern.finditer(text):
            if found.start() < len(lines[number]) and _error_fits(text[:found.start()], signature.error):
                return text
    return None


def _window(lines, number):
    """Line numbers (0-based, a range) of the traceback around the message at `number`: from its `Traceback`
    line (or _BEFORE lines up) to the next traceback (or _AFTER lines down)."""
    start = max(0, number - _BEFORE)
    for back in range(number, max(-1, number - 4 * _BEFORE), -1):
        if _TRACEBACK in lines[back]:
            start = back
            break
    end = min(len(lines), number + _AFTER + 1)
    for ahead in range(number + 1, end):
        if _TRACEBACK in lines[ahead]:
            end = ahead
            break
    return range(start, end)


def _first(lines, where, pattern):
    found = pattern if callable(pattern) else re.compile(pattern).search
    return next((n for n in _present(lines, where) if found(lines[n])), None)


def log_versions(lines):
    """{distribution: version} printed in the log, for those it prints one version of."""
    seen = {}
    for number in _present(lines):
        line = lines[number]
        for name, version in _VERSION.findall(line):
            seen.setdefault(name.lower(), {}).setdefault(version, number)
        for version in _DEEPSPEED_BANNER.findall(line):
            seen.setdefault("deepspeed", {}).setdefault(version, number)
    return {name: (next(iter(found)), next(iter(found.values())) + 1)
            for name, found in seen.items() if len(found) == 1}


def _hits(lines, patches):
    """Every place a patch's signature matches: {line number: [hit]}, a hit the patch, its signature, the text
    and the line numbers that decided (needs, and the hint if one matched). `needs` are looked for in the message's
    traceback; `context`, `hints` and `unless` in the whole log."""
    hits = {}
    everywhere = range(len(lines))
    holding = {}  # trigger word -> numbers of the lines that hold it
    for patch in patches:
        for signature in patch.signatures:
            trigger = _trigger(signature.message)
            if trigger:  # only where the message's word is, on its line or up to _JOINED lines below
                for word in trigger[0]:
                    if word not in holding:
                        holding[word] = [n for n in _present(lines) if word in lines[n]]
                starts = sorted({max(0, n - k) for word in trigger[0] for n in holding[word]
                                 for k in range(_JOINED + 1)})
            else:
                starts = _present(lines)
            for number in starts:
                text = _message_at(lines, number, signature)
                if text is None:
                    continue
                where = _window(lines, number)
                needed = [_first(lines, where, p) for p in signature.needs]
                if None in needed or any(_first(lines, everywhere, p) is None for p in signature.context):
                    continue
                if any(_first(lines, everywhere, p) is not None for p in signature.unless):
                    continue
                hint = next((n for n in (_first(lines, everywhere, p) for p in signature.hints) if n is not None),
                            None)
                found = needed + [_first(lines, everywhere, p) for p in signature.context]
                hits.setdefault(number, []).append(
                    {"patch": patch, "signature": signature, "text": text, "evidence": found, "hint": hint})
                break  # this signature's first full match; later repeats (other ranks) add nothing
    return hits


def _in_range(version, specifier):
    from dspatch.versions import SpecifierSet
    from dspatch.versions import InvalidVersion, Version

    try:
        return SpecifierSet(specifier or "").contains(Version(version), prereleases=True)
    except InvalidVersion:
        return True  # not a release version: it cannot rule a candidate out


def _outside(patch, versions):
    """Why `versions` ({distribution: version}) rule the patch's bug out, or None."""
    wanted = {patch.distribution: patch.affected, **patch.requires}
    for name, specifier in wanted.items():
        if name in versions and not _in_range(versions[name], specifier):
            return f"{name} {versions[name]} is outside {specifier}"
    return None


def _environment_versions(names):
    from dspatch.gating import installed_version

    found = {}
    for name in names:
        version = installed_version(name)
        if version:
            found[name] = version
    return found


def _decide(lines, candidates, printed):
    """For the hits at one line: (those still standing, how they were told apart, the versions used, whether this
    environment's versions decided, the hits set aside because this environment's versions rule them out)."""
    how, used = [], {}
    specific = [c for c in candidates if not c["signature"].generic]
    if specific and len(specific) < len(candidates):
        how.append("its message is more specific than " + ", ".join(
            c["patch"].id for c in candidates if c["signature"].generic))
        candidates = specific
    shown = {name: version for name, (version, _) in printed.items()}
    standing = []
    for candidate in candidates:
        reason = _outside(candidate["patch"], shown)
        if reason:
            how.append(f"not {candidate['patch'].id}: the log shows {reason}")
        else:
            standing.append(candidate)
    for candidate in standing:
        for name in (candidate["patch"].distribution, *candidate["patch"].requires):
            if name in printed:
                used[name] = f"{printed[name][0]} (printed at line {printed[name][1]})"
    candidates = standing
    if len(candidates) > 1 and any(c["hint"] is not None for c in candidates):
        hinted = [c for c in candidates if c["hint"] is not None]
        if len(hinted) < len(candidates):
            for c in hinted:
                how.append(f"line {c['hint'] + 1} points to it: {lines[c['hint']].strip()[:160]}")
            candidates = hinted
    # what the log does not print: the versions installed here (explain runs where the job ran, as a rule)
    names = {n for c in candidates for n in (c["patch"].distribution, *c["patch"].requires) if n not in printed}
    here = _environment_versions(names) if names else {}
    if not here:
        return candidates, how, used, False, []
    inside = [c for c in candidates if not _outside(c["patch"], here)]
    aside = [c for c in candidates if c not in inside]
    for c in inside:
        for name in (c["patch"].distribution, *c["patch"].requires):
            if name in here:
                used[name] = f"{here[name]} (installed here; the log prints none)"
    if aside and inside:
        how.append("the versions installed here rule out " + ", ".join(c["patch"].id for c in aside)
                   + " (if the log came from another machine, check its versions)")
    return inside, how, used, bool(aside and inside), aside


def find(lines, patches):
    """(named, undecided, set aside): named, one dict per bug the log decides ({patch, line, text, confidence,
    why, versions}); undecided, one per message that two known bugs (or a known bug and a failure no patch fixes,
    `Signature.also`) give and the log cannot tell apart ({patches, line, text, why, tell, also}); set aside, the
    bugs whose message the log shows but that the versions installed here do not have ({patch, line, text,
    reason})."""
    printed = log_versions(lines)
    named, undecided, aside = [], [], []
    for number, candidates in sorted(_hits(lines, patches).items()):
        standing, how, used, from_here, ruled_out = _decide(lines, candidates, printed)
        if not standing:
            here = _environment_versions({c["patch"].distribution for c in ruled_out})
            aside += [{"patch": c["patch"], "line": number + 1, "text": c["text"],
                       "reason": _outside(c["patch"], here)} for c in ruled_out]
            continue
        # a failure no patch fixes writes the same lines: only a hint decides (a choice between known bugs that
        # the versions settled is no decision against it)
        also = [c["signature"].also for c in standing if c["signature"].also]
        if len(standing) > 1 or (also and standing[0]["hint"] is None):
            undecided.append({"patches": [c["patch"] for c in standing], "line": number + 1,
                              "text": standing[0]["text"], "why": how, "versions": used,
                              "tell": {c["patch"].id: c["signature"].tell for c in standing}, "also": also})
            continue
        (hit,) = standing
        why = [f"line {n + 1}: {lines[n].strip()[:160]}" for n in hit["evidence"]] + how
        if hit["hint"] is not None and len(candidates) == 1:
            why.append(f"line {hit['hint'] + 1}: {lines[hit['hint']].strip()[:160]}")
        named.append({"patch": hit["patch"], "line": number + 1, "text": hit["text"],
                      "confidence": "likely" if from_here else "certain", "why": why, "versions": used})
    # one bug per report: the first place it is decided; a choice that includes a named bug is that bug, seen again
    seen, unique = set(), []
    for item in named:
        if item["patch"].id not in seen:
            seen.add(item["patch"].id)
            unique.append(item)
    choices = [u for u in undecided if not seen & {p.id for p in u["patches"]}]
    once = []
    for item in aside:
        if item["patch"].id not in seen:
            seen.add(item["patch"].id)
            once.append(item)
    return unique, choices, once


def _where_the_job_ran(patch, logged):
    """What to do where the log came from, when this environment is not where its bug is: the release the log
    printed (or the patch's range, where it printed none), and the DSPATCH that fixes the job there."""
    fix = f"DSPATCH={patch.id} (or DSPATCH=1) on every rank fixes it there"
    upgrade = f", as does {patch.distribution} {patch.fixed_in} or later" if patch.fixed_in else ""
    version = logged.get(patch.distribution)
    if version and not _outside(patch, logged):
        if patch.supported and not _in_range(version, patch.supported):
            return (f"the job's {patch.distribution} {version} has this bug, but the patch is written for "
                    f"{patch.supported} only: upgrade to {patch.fixed_in or 'a release with the fix'}")
        return f"the job ran {patch.distribution} {version} (printed in the log), which has this bug: {fix}{upgrade}"
    span = "every release" if patch.affected.strip() in ("", ">=0") else patch.affected
    return f"where the job ran a {patch.distribution} with the bug ({span}), {fix}{upgrade}"


def advice(patch, environ=None, logged=None):
    """(verdict, reason, active, what to do) for this environment, and the job the log came from (`logged`: the
    versions the log prints, {distribution: version})."""
    from dspatch import gating, registry

    env = os.environ if environ is None else environ
    logged = logged or {}
    found = gating.evaluate(patch)
    version, verdict, reason = found.version, found.verdict, found.reason
    try:
        selected = patch.id in registry.selection(None, env, "DSPATCH")[0] if registry.active(env) else False
    except registry.SelectionError:
        selected = False
    if verdict == gating.APPLIES and not (logged.get(patch.distribution, version) != version
                                          and _outside(patch, logged)):
        if selected:
            todo = ("it is active here (DSPATCH selects it); if this log comes from a job run with it active, "
                    "the fix did not hold: please report it with the log")
        else:
            todo = f"set DSPATCH={patch.id} (or DSPATCH=1) for the job, on every rank"
    else:
        todo = _where_the_job_ran(patch, logged)
        if verdict == gating.DRIFTED:
            todo += "; here dspatch leaves this install alone: its source is not a known release's"
    return verdict, reason, selected, todo


def _entry(patch, environ, logged=None):
    verdict, reason, active, todo = advice(patch, environ, logged)
    return {"id": patch.id, "cause": patch.cause or patch.summary, "fix": patch.summary, "verdict": verdict,
            "reason": reason, "active": active, "do": todo, "links": list(patch.links)}


def explain(text, patches=None, environ=None):
    """(lines read, bugs named, choices left open, bugs set aside by the versions here): JSON-ready dicts. `text` is
    the log (a str) or its lines as skim gives them."""
    from dspatch import registry

    patches = list(registry.all_patches().values()) if patches is None else patches
    lines = clean_lines(text) if isinstance(text, str) else text
    named, undecided, aside = find(lines, patches)
    logged = {name: version for name, (version, _) in log_versions(lines).items()}
    bugs = [{**_entry(item["patch"], environ, logged), "line": item["line"], "text": item["text"],
             "confidence": item["confidence"], "why": item["why"], "versions": item["versions"]}
            for item in named]
    choices = [{"ids": [p.id for p in item["patches"]], "line": item["line"], "text": item["text"],
                "why": item["why"], "versions": item["versions"], "also": item["also"],
                "candidates": [{**_entry(p, environ, logged), "tell": item["tell"][p.id]} for p in item["patches"]]}
               for item in undecided]
    set_aside = [{**_entry(item["patch"], environ, logged), "line": item["line"], "text": item["text"],
                  "ruled_out": item["reason"]} for item in aside]
    return len(lines), bugs, choices, set_aside


# ---- reading a log of any size: two skims for a few fixed words, then only the lines around what they found ------

_CHUNK = 16 << 20  # bytes read at a time: memory stays a few chunks whatever the log's size
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{3,}")


@functools.lru_cache(maxsize=None)
def _required(pattern):
    """Fixed strings, one of which is in every text the regular expression matches (None when it cannot tell), so
    that a line holding none of them can be skipped unread. Read from the pattern's parse tree (once per pattern:
    skim and every find() ask)."""
    try:
        from re import _parser as parser, _constants as constants
    except ImportError:  # Python < 3.11
        import sre_constants as constants
        import sre_parse as parser

    def needed(items):
        best, run = None, []

        def consider(found):
            nonlocal best
            if found and min(map(len, found)) >= 3 and (best is None or min(map(len, found)) > min(map(len, best))):
                best = found

        for op, value in items:
            if op is constants.LITERAL:
                run.append(chr(value))
                continue
            if op is constants.AT:  # \b, ^, $: they match no character
                continue
            consider({"".join(run)} if run else None)
            run = []
            if op is constants.SUBPATTERN:
                consider(needed(value[-1]))
            elif op is constants.BRANCH:
                branches = [needed(branch) for branch in value[1]]
                consider(set().union(*branches) if all(branches) else None)
            elif op in (constants.MAX_REPEAT, constants.MIN_REPEAT) and value[0] >= 1:
                consider(needed(value[2]))
        consider({"".join(run)} if run else None)
        return best

    parsed = parser.parse(pattern)
    if parsed.state.flags & constants.SRE_FLAG_IGNORECASE:
        return None
    found = needed(list(parsed))
    return frozenset(found) if found else None


def _trigger(pattern):
    """(the word a line must hold for the message to start there or up to _JOINED lines above, the words of each of
    the message's fixed texts) or None. The word is the longest of the fixed texts' words (a wrap that cuts it
    hides the message); two of a fixed text's words must then be in those lines (a wrap cuts at most those two)."""
    found = _required(pattern)
    if not found:
        return None
    words = [_WORD.findall(text) or [text] for text in sorted(found)]
    return sorted({max(each, key=len) for each in words}), words


def _plan(patches):
    """(message triggers {word: [(patch, signature, the words of its fixed texts)]}, the fixed texts its log-wide
    patterns need per signature) or None when a pattern has no fixed text (then every line is read)."""
    triggers, anywhere = {}, {}
    for patch in patches:
        for signature in patch.signatures:
            trigger = _trigger(signature.message)
            if not trigger:
                return None
            for word in trigger[0]:
                triggers.setdefault(word, []).append((patch, signature, trigger[1]))
            texts = set()
            for pattern in (*signature.context, *signature.hints, *signature.unless):
                found = None if callable(pattern) else _required(pattern)
                if not found:
                    return None
                texts |= found
            anywhere[signature] = texts
    return triggers, anywhere


def _message_lines(chunk, first, word, uses):
    """Line numbers of the chunk where a message of `uses` may start: a line that holds `word`, or one of the
    _JOINED lines above it, when those lines also hold two words of one of its fixed texts (all, if it has one)."""
    found = set()
    at = chunk.find(word)
    while at >= 0:
        start = chunk.rfind(b"\n", 0, at) + 1
        for _ in range(_JOINED):
            start = chunk.rfind(b"\n", 0, max(start - 1, 0)) + 1 if start else 0
        end = at
        for _ in range(_JOINED + 1):
            end = chunk.find(b"\n", end + 1)
            if end < 0:
                end = len(chunk)
                break
        near = chunk[start:end]
        if any(sum(w.encode() in near for w in words) >= min(2, len(words))
               for _, _, alternatives in uses for words in alternatives):
            found.add(start)
        at = chunk.find(word, chunk.find(b"\n", at) + 1 or len(chunk))
    return {n + k for n in _numbered(chunk, first, found) for k in range(_JOINED + 1)}


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


_ANSI_BYTES = re.compile(_ANSI.pattern.encode())  # the same codes, in the raw bytes


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
        into[number] = _clean((chunk[start:] if end < 0 else chunk[start:end]).decode("utf-8", errors="replace"))
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
    plan = _plan(patches)
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
    # a message's traceback reaches 4 * _BEFORE lines up, its wrapped lines _JOINED down
    around = set()
    for n in hits:
        around.update(range(max(0, n - 4 * _BEFORE - _JOINED), min(count, n + _AFTER + _JOINED + 1)))
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
    _join_debugger_lines(lines, [n for n in lines.numbers if n + 1 < count])
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


def _lines(bugs, choices, aside, count, source):
    out = []
    if not bugs and not choices and not aside:
        out.append(f"No known bug found in {count} lines of {'standard input' if source == '-' else source}. "
                   f"dspatch knows the log lines of {len(_known_ids())} bugs (`dspatch check -v` lists every patch).")
    for item in bugs:
        out.append(f"{item['cause']} ({item['id']})")
        out.append(f"  seen at line {item['line']}: {item['text'][:200]}")
        out.append(f"  {item['confidence']}" + (f": {'; '.join(item['why'])}" if item["why"] else ""))
        if item["versions"]:
            out.append("  versions: " + ", ".join(f"{k} {v}" for k, v in item["versions"].items()))
        out.append(f"  fix: {item['fix']}")
        out.append(f"  here: {item['verdict']} ({item['reason']}){'; active' if item['active'] else ''}")
        out.append(f"  do: {item['do']}")
    for item in choices:
        known = f"one of {len(item['ids'])} known bugs" if len(item["ids"]) > 1 else "a known bug"
        out.append(f"line {item['line']} shows {known}{', or a failure no patch fixes,' if item['also'] else ''} and "
                   f"the log does not say which: {item['text'][:200]}")
        out += [f"  ({why})" for why in item["why"]]
        for candidate in item["candidates"]:
            out.append(f"  - {candidate['id']}: {candidate['cause']}")
            if candidate["tell"]:
                out.append(f"    it is this one if {candidate['tell']}")
            out.append(f"    here: {candidate['verdict']} ({candidate['reason']}); do: {candidate['do']}")
        out += [f"  - or, with no dspatch fix: {other}" for other in item["also"]]
    for item in aside:
        out.append(f"line {item['line']} has the message of {item['id']} ({item['cause']}), which this environment "
                   f"does not have: {item['ruled_out']}; {item['do']}")
        out.append(f"  seen: {item['text'][:200]}")
    return out


def arguments(parser):
    parser.add_argument("log", nargs="?", default="-", help="the log file (.gz too), or - for standard input "
                        "(default)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    return parser


def command(args, prog="dspatch explain"):
    if args.log == "-" and sys.stdin.isatty():
        print(f"usage: {prog} LOG [--json]\n{prog}: give a log file, or pipe one in (`... 2>&1 | {prog} -`)",
              file=sys.stderr)
        return 2
    from dspatch import registry

    try:
        registry.selection()  # what `here:` says reads DSPATCH: a bad value is refused, as by every command
    except registry.SelectionError as e:
        print(f"dspatch: {e}; nothing is applied", file=sys.stderr)
        return 2
    try:
        with open_log(args.log) as f:
            text = skim(f, list(registry.all_patches().values()))
    except (OSError, EOFError, Unreadable) as e:  # EOFError: a gzip cut short
        print(f"{prog}: cannot read {'standard input' if args.log == '-' else args.log}: "
              f"{getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    count, bugs, choices, aside = explain(text)
    if args.json:
        print(json.dumps({"lines": count, "bugs": bugs, "undecided": choices, "set_aside": aside}))
    else:
        from dspatch import term

        term.out(_lines(bugs, choices, aside, count, args.log))
    return 0 if bugs or choices or aside else 1


def main(argv=None, prog="python -m dspatch.explain"):
    parser = arguments(argparse.ArgumentParser(prog=prog, description="Name the known bugs a failed job's log "
                                               "shows (exit 0), or say that it shows none (exit 1)."))
    return command(parser.parse_args(argv), prog)


def _known_ids():
    from dspatch import registry

    return [pid for pid, p in registry.all_patches().items() if p.signatures]


if __name__ == "__main__":
    from dspatch import term

    term.exit_with(main)

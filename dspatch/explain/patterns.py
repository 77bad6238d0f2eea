"""What a patch's signatures need a line to hold: the fixed strings of their regular expressions, read from the
pattern's parse tree, so that a log's lines holding none of them are never matched (or, by skim, read)."""
import functools
import re

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


def trigger_words(pattern):
    """(the word a line must hold for the message to start there or up to JOINED lines above, the words of each of
    the message's fixed texts) or None. The word is the longest of the fixed texts' words (a wrap that cuts it
    hides the message); two of a fixed text's words must then be in those lines (a wrap cuts at most those two)."""
    found = _required(pattern)
    if not found:
        return None
    words = [_WORD.findall(text) or [text] for text in sorted(found)]
    return sorted({max(each, key=len) for each in words}), words


def signature_plan(patches):
    """(message triggers {word: [(patch, signature, the words of its fixed texts)]}, the fixed texts its log-wide
    patterns need per signature) or None when a pattern has no fixed text (then every line is read)."""
    triggers, anywhere = {}, {}
    for patch in patches:
        for signature in patch.signatures:
            trigger = trigger_words(signature.message)
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

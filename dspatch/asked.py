"""What a command was asked about: the ids it was given (positionally and with --only) or DSPATCH's selection, and
one rule for what cannot be used (BadInput: one line, exit 2), every command alike."""
import sys

from dspatch import registry


class BadInput(Exception):
    """What the user gave cannot be used: one line, exit 2."""


def say(message):
    print(f"dspatch: {message}", file=sys.stderr, flush=True)


def selection_or_bad_input(ids=None, source="DSPATCH"):
    """The selection, or BadInput for a malformed DSPATCH/DSPATCH_DISABLE (or ids): one rule, every command."""
    try:
        return registry.selection(ids, source=source)
    except registry.SelectionError as e:
        raise BadInput(f"{e}; nothing is applied") from None


def _ids(args):
    """The ids a command was given (positionally and with --only), or None for DSPATCH's selection."""
    ids = list(getattr(args, "ids", None) or [])
    only = getattr(args, "only", None)
    if only is not None:
        if not only:
            raise BadInput(f"--only '' names no patch ({registry.HOW})")
        ids += only
    return ids or None


def asked_rows(args):
    """(rows of the patches asked about, whether ids were given). Raises BadInput."""
    from dspatch import status

    selection_or_bad_input()  # DSPATCH is read even where ids are given: a bad one is said, everywhere alike
    ids = _ids(args)
    if ids is None:
        return status.check_all(None), False
    source = f"--only {registry.short(','.join(args.only))}" if getattr(args, "only", None) \
        else registry.short(" ".join(ids))
    try:
        chosen, _ = registry.selection(ids, source=source)
    except registry.SelectionError as e:
        raise BadInput(str(e)) from None
    return [row for row in status.check_all(ids, source=source) if row.patch.id in chosen], True


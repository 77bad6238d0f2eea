"""Start a patch: `python tools/new_patch.py deepspeed/some-bug` writes dspatch/patches/deepspeed/some_bug/.

The folder it writes is everything about the patch that is written by hand except its diffs (upstream_prs/): the fix
and its declaration (`__init__.py`), the reproducers and what they prove (`reproducers.py`), the patch's own tests
(`test_some_bug.py`) and an empty `logs/` for the real logs of the bug. The registry finds it at once; nothing else is
edited. The template loads (the registry's checks pass) and fails until filled in: its fix and its reproducer raise
NotImplementedError, its placeholder target matches no installed source (so it never applies), and the registry's
tests refuse a patch without fingerprints, links or a band of releases checked.
CONTRIBUTING.md says what to fill in, in order.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FIX = '''"""{id}: TODO one line: what goes wrong upstream (the patch page's title).

TODO the story, which becomes the patch's page: what breaks and how a user sees it, the releases with the bug (checked
from their sources), upstream's issue and the PR that fixes it (or that it is open), and how the fix works and why it
changes nothing else.
"""
from dspatch.spec import Patch


def apply(txn):
    """Install the fix through `txn` (dspatch._runtime.Transaction): `txn.wrap(target, wrapper)`, or
    `txn.recode(target, transform)` to rebuild a target from the installed source (dspatch.rewrite's helpers)."""
    raise NotImplementedError("{id}: write the fix")


PATCH = Patch(
    id="{id}",
    summary="TODO what the patch does about it",
    cause="TODO what goes wrong on stock upstream, in one sentence",
    symptom="TODO what a user sees: the error's own words, or for a silent bug the wrong result",
    distribution="{package}",
    affected=">=0",  # TODO the releases with the bug (a PEP 440 specifier)
    fixed_in=None,  # the first release fixed upstream; None while open
    # {{(module, qualname): {{fingerprint: "first-last release"}}}}: `python tests/upstream_releases.py {id} FIRST LAST`
    # prints the fingerprints. Until then no source matches this placeholder: the patch is left out, never applied.
    targets={{("{package}", "TODO_the_function_it_fixes"): {{}}}},
    apply=apply,
    links=(),  # TODO upstream's issue and PR
    diffs=(),  # ("{package}/NNNN-{name}-<first>-<last>.patch", ...): one per band of released source, named for it
)
'''

REPRODUCERS = '''"""Reproducers of {id}: real upstream objects on the CPU (dspatch.scenario has the building blocks).

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof  # noqa: F401 (a reproducer raises BugSeen)


def {scenario}():
    """TODO: build real upstream objects, hit the bug, and raise BugSeen("<what went wrong>") when, and only when, the
    bug's own failure shows; return None when the behaviour is right."""
    raise NotImplementedError("{id}: write the reproducer")


PROOF = Proof(
    scenarios={{"{scenario}": {scenario}}},
    expected_on_stock={{"{scenario}": "TODO a fragment of the BugSeen message stock shows"}},
    releases_checked=("0", "0"),  # TODO the first and last release the release suite checks
)
'''

OWN_TESTS = '''"""{id}: what only this patch needs beyond the proofs every patch gets (tests/test_proofs*.py): numbers it must
match, what must stay stock. Delete the file if there is nothing."""
import pytest

from dspatch import registry

PID = "{id}"


@pytest.mark.unit_only
def test_declared():
    assert all(t.fingerprints for t in registry.all_patches()[PID].targets), "declare the targets (CONTRIBUTING.md)"
'''


def main(argv):
    if len(argv) != 1 or not re.fullmatch(r"[a-z][a-z0-9]*/[a-z][a-z0-9]*(-[a-z0-9]+)*", argv[0]):
        sys.exit("usage: python tools/new_patch.py PACKAGE/NAME  (e.g. deepspeed/zero3-some-bug: lowercase words and "
                 "dashes)")
    pid = argv[0]
    package, dashed = pid.split("/")
    name = dashed.replace("-", "_")
    base = os.path.join(ROOT, "dspatch", "patches", package)
    folder = os.path.join(base, name)
    if os.path.exists(folder):
        sys.exit(f"{os.path.relpath(folder, ROOT)} exists already")
    if not os.path.isdir(base):  # a patch for a package dspatch has none for yet: its import becomes watched too
        os.makedirs(base)
        with open(os.path.join(base, "__init__.py"), "w") as f:
            f.write(f'"""Patches for {package}: one folder each (see dspatch/patches/__init__.py)."""\n')
    os.makedirs(os.path.join(folder, "logs"))
    fields = {"id": pid, "package": package, "name": name, "scenario": name}
    for file, text in (("__init__.py", FIX), ("reproducers.py", REPRODUCERS), (f"test_{name}.py", OWN_TESTS)):
        with open(os.path.join(folder, file), "w") as f:
            f.write(text.format(**fields))
    with open(os.path.join(folder, "logs", ".keep"), "w"):
        pass
    print(f"wrote {os.path.relpath(folder, ROOT)}/: __init__.py, reproducers.py, test_{name}.py, logs/. "
          "CONTRIBUTING.md ('Adding a patch') says what to fill in, in order.")


if __name__ == "__main__":
    main(sys.argv[1:])

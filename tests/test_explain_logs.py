"""dspatch.explain on logs real users pasted into public upstream threads: a patch's in its folder's logs/, the
look-alikes that are no patch's bug in tests/explain_logs/.

Each file is one log: a header (`# source:` the thread, `# expect:` the patch whose bug it shows, `none` for a
failure that looks alike but has another cause, `ambiguous` where the thread itself cannot say; `# why:` how the
thread tells; optionally `# environment:` the versions the thread reports, as explain would find them installed,
and `# decides: no (...)` where the log lacks what tells the bug from the look-alikes) and then only the
machine-written lines, as pasted: frames, messages, rank prefixes, wraps, noise.

The rules: no log names a wrong patch (a wrong name sends a user to a fix for a bug they do not have); every log
that decides names its bug; a log that cannot decide names nothing (it may list its bug among candidates); a log
of another failure offers a bug only beside that failure, where it writes the same lines (`Signature.also`).
"""
import glob
import os
import re

import pytest

from dspatch import explain, registry
from dspatch.explain import logfile, match

pytestmark = pytest.mark.unit_only

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "explain_logs")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN = os.path.join(ROOT, "dspatch", "patches")  # <package>/<name>/logs/*.log: the logs of that patch's bug
LOGS = sorted(glob.glob(os.path.join(FOLDER, "*", "*.log"))) + sorted(glob.glob(os.path.join(OWN, "*", "*", "logs", "*.log")))
PATCHES = registry.all_patches()
HEADER = re.compile(r"^# (source|expect|why|versions|environment|decides): (.*)$")


def read(path):
    """(header fields, the log's own text)."""
    header, body = {}, []
    with open(path, encoding="utf-8") as f:
        for line in f.read().split("\n"):
            found = HEADER.match(line)
            if found and not body:
                header[found.group(1)] = found.group(2).strip()
            else:
                body.append(line)
    return header, "\n".join(body)


def verdict(path, monkeypatch):
    header, text = read(path)
    installed = dict(pair.split("=") for pair in header.get("environment", "").split())
    # the machine the thread's job ran on, not this one
    monkeypatch.setattr(match, "_environment_versions",
                        lambda names: {n: v for n, v in installed.items() if n in names})
    named, undecided, _ = explain.find(explain.clean_lines(text), list(PATCHES.values()))
    return (header, [n["patch"].id for n in named], [[p.id for p in u["patches"]] for u in undecided],
            [bool(u["also"]) for u in undecided])


def test_the_logs_are_as_described():
    assert len(LOGS) >= 100
    linked = {link for patch in PATCHES.values() for link in patch.links}
    elsewhere = 0
    for path in LOGS:
        header, text = read(path)
        assert re.match(r"https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+$", header["source"]), path
        if path.startswith(FOLDER):
            assert header["expect"] in ("none", "ambiguous"), path  # a log of a patch's bug goes to its folder
        else:  # in the folder of the patch it shows
            package, name = os.path.relpath(path, OWN).split(os.sep)[:2]
            assert header["expect"] == f"{package}/{name.replace('_', '-')}", path
        assert header.get("why") and text.strip(), path
        elsewhere += header["source"] not in linked
    assert elsewhere >= len(LOGS) / 3  # at least a third from threads the patches do not link


@pytest.mark.parametrize("path", LOGS, ids=[os.path.relpath(p, FOLDER if p.startswith(FOLDER) else OWN) for p in LOGS])
def test_explain_on_a_real_log(path, monkeypatch):
    header, named, undecided, also = verdict(path, monkeypatch)
    expect = header["expect"]
    if expect in ("none", "ambiguous"):
        assert named == [], f"{header['source']}: named {named} on a log of another failure"
        if expect == "none":  # a bug may be offered only beside the failure no patch fixes that writes the same
            assert all(also), f"{header['source']}: offered {undecided} on a log of another failure"
    elif header.get("decides", "").startswith("no"):
        assert named == [] and all(expect in choice for choice in undecided), (named, undecided)
    else:
        assert named == [expect], f"{header['source']}: named {named}, undecided {undecided}"


def test_how_often_the_right_bug_is_named(monkeypatch, capsys):
    """Printed for the README and the notes (-s shows it): per bug, how many of its logs name it."""
    shown = {}
    for path in LOGS:
        header, named, _, _ = verdict(path, monkeypatch)
        if header["expect"] in PATCHES:
            right, total = shown.get(header["expect"], (0, 0))
            shown[header["expect"]] = (right + (named == [header["expect"]]), total + 1)
    with capsys.disabled():
        print(f"\nexplain on {len(LOGS)} real logs ({sum(t for _, t in shown.values())} showing a known bug):")
        for pid, (right, total) in sorted(shown.items()):
            print(f"  {pid}: named in {right} of {total}")
    right = sum(r for r, _ in shown.values())
    total = sum(t for _, t in shown.values())
    undecidable = sum(1 for path in LOGS if read(path)[0].get("decides", "").startswith("no"))
    assert right == total - undecidable


# versions printed in the ways _VERSION reads them (a no-break space, dots, quotes), beside names that print none
# (paths, variables): far from the messages, only the search for names finds them
VERSIONS = ("torch\u00a02.1.0 `trl` version: 0.11.4 accelerate.......1.0.0 DeepSpeed info: version=0.14.4\n"
            "/site-packages/torch/utils/x.py TORCH_NCCL_X=1 Transformers==4.44.2 PEFT:0.13.0\n")


@pytest.mark.parametrize("grep", [True, False], ids=["grep", "python-search"])
@pytest.mark.parametrize("chunk", [1 << 24, 97])
def test_a_log_skimmed_from_its_file_reads_as_the_whole_log(chunk, grep, monkeypatch, tmp_path):
    """What the command line reads (dspatch.explain.logfile: grep, or plain search, for each message's words, then only the lines
    around them and those the log-wide patterns and versions need) decides every real log as reading every line
    does: the same bugs named, the same choices, the same line numbers; also when each log is buried in 4,000
    lines of training output and when the chunks it is read in are cut every 97 bytes."""
    noise = "".join(f"[rank{i % 2}]: {{'loss': 0.{i:04d}, 'grad_norm': 1.2}} step {i}/4000 [00:01<00:09]\r\n"
                    for i in range(4000))
    monkeypatch.setattr(logfile, "_CHUNK", chunk)
    if grep:  # grep picks the chunks where a message's word is; Python's own search, where there is no grep
        assert logfile._GREP, "no grep on this machine: the skim's grep prefilter is not checked"
    else:
        monkeypatch.setattr(logfile, "_GREP", None)
    patches = list(PATCHES.values())
    for number, path in enumerate(LOGS):
        header, text = read(path)
        installed = dict(pair.split("=") for pair in header.get("environment", "").split())
        monkeypatch.setattr(match, "_environment_versions",
                            lambda names: {n: v for n, v in installed.items() if n in names})
        if chunk < 1000 and number % 10:  # small chunks: every tenth log (CI time)
            continue
        bodies = {0: (text, noise + text + "\n" + noise[:20000]), 1: (text, VERSIONS + noise + text + noise + VERSIONS)}.get(number % 3, (text,))
        for body in bodies:
            file = tmp_path / "job.log"
            file.write_text(body, encoding="utf-8")
            with open(file, "rb") as f:
                skimmed = explain.find(explain.skim(f, patches), patches)
            whole = explain.find(explain.clean_lines(body), patches)
            summary = [[[(item["patch"].id if "patch" in item else [p.id for p in item["patches"]], item["line"])
                         for item in kind] for kind in part] for part in (skimmed, whole)]
            assert summary[0] == summary[1], (path, summary)

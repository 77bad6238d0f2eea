"""Every dspatch command shown in README.md, CONTRIBUTING.md and docs/ runs as written (issue 48): a doc cannot show a
flag that does not exist again. Each is run in the unit session (no stack: nothing applies there) with its
placeholders filled (an id, a real log, a script, requirements files); it must parse and end without a traceback:
exit 0, 1 (it found something) or 5 (nothing to run here), never 2 (usage)."""
import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, clean_env

pytestmark = pytest.mark.unit_only

DOCS = ["README.md", "CONTRIBUTING.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]
# a command: optional VAR=value words, then dspatch or python -m dspatch(.module), up to the end of its code span
COMMAND = re.compile(r"((?:[A-Z_]+=\S+ )*(?:dspatch|python3? -m dspatch(?:\.\w+)?)(?: [^`#\n]*)?)")
SPAN = re.compile(r"`([^`\n]+)`")
ID = "deepspeed/engine-module-hint"
NAMES = {"dspatch audit", "dspatch export", "dspatch run", "dspatch canary"}
FILES = {"ds_config.json": '{"zero_optimization": {"stage": 2}}\n'}  # in prose, the name of a command: no input of its own
# what the docs show as a mistake, and say is refused
REFUSED = {"dspatch run --only bogus train.py"}
# placeholders as the docs write them, and what stands in for them here
FILL = [(r"<id>|\bID\.\.\.|\bIDS\b|\bID\b|\bdeepspeed/some-bug\b", ID), (r"\bLOG\b|\bjob\.log(\.gz)?\b", "job.log"),
        (r"\bARGS\b|\[args\.\.\.\]", "--lr 1"), (r"\bCHECKOUT\b", "checkout"), (r"\bMODULE\b|\bpackage\.module\b", "job"),
        (r"\bSCRIPT\b|\bscript\.py\b", "train.py"), (r"\bDIR\b|\bprs/", "out/"), (r"\bFILE\.\.\.|\bFILE\b", "train.txt"),
        (r'\bPINS\b', '"deepspeed==0.16.9"'), (r"\bD\b", "cpu"), (r"\bCOMMAND\b", "check")]


def commands():
    """{command as written: the files that show it}, from code blocks (fenced or indented) and inline code."""
    found = {}
    for path in DOCS:
        text = open(os.path.join(ROOT, path), encoding="utf-8").read()
        pieces = [line for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S) for line in block.splitlines()]
        pieces += [line for line in text.splitlines() if line.startswith("    ") and "dspatch" in line]
        pieces += SPAN.findall(text)
        for piece in pieces:
            piece = piece.split("  #")[0].strip()
            left, bar, right = piece.partition("|")
            if bar and "dspatch" in right and ("some-command" in left or left.strip().startswith("...")):
                piece = "cat job.log | " + right.strip()  # `... | dspatch explain -`: a log as its input
            if path.startswith(os.path.join(ROOT, "docs", "patches", "")) and path.count(os.sep) > \
                    os.path.join(ROOT, "docs", "patches").count(os.sep) + 1:  # a patch's page: its own id is ID
                piece = piece.replace(os.path.relpath(path, os.path.join(ROOT, "docs", "patches"))[:-3], "ID")
            for match in COMMAND.finditer(piece):
                command = match.group(1).strip().rstrip(".,;:)")
                if command.split()[-1] in ("dspatch", "-m") or command.startswith("dspatch:") or command in NAMES \
                        or re.match(r"dspatch \w+ \S+: ", command):
                    continue  # a name in prose, or a command's output quoted (`dspatch canary X: ...`)
                if "python -m dspatch.docs" in command:  # it writes the checkout: its check form only
                    command = "python -m dspatch.docs"
                prefix = piece[:match.start()] if bar and "dspatch" in right else ""
                found.setdefault(prefix + command, set()).add(os.path.relpath(path, ROOT))
    return found


def fill(command):
    for pattern, value in FILL:
        command = re.sub(pattern, value, command)
    return command


def _fixtures(folder):
    log = os.path.join(ROOT, "dspatch", "patches", "accelerate", "deepspeed_no_sync", "logs", "hf-nosync-01.log")
    body = [line for line in open(log, encoding="utf-8").read().splitlines() if not line.startswith("# ")]
    (folder / "job.log").write_text("\n".join(body) + "\n")
    (folder / "train.py").write_text("import sys\nprint('trained', sys.argv[1:])\n")
    (folder / "job.py").write_text("print('job')\n")
    for name, text in FILES.items():
        (folder / name).write_text(text)
    (folder / "checkout").mkdir()
    (folder / "requirements").mkdir()
    for name in ("train.txt", "requirements.txt", "requirements/train.txt"):
        (folder / name).write_text("deepspeed==0.16.9\ntransformers==4.46.3\n")
    (folder / "requirements" / "constraints.txt").write_text("torch==2.6.0\n")
    for name in ("uv.lock", "poetry.lock"):
        (folder / name).write_text('[[package]]\nname = "deepspeed"\nversion = "0.16.9"\n')
    (folder / "pylock.toml").write_text('lock-version = "1.0"\n[[packages]]\nname = "deepspeed"\nversion = "0.16.9"\n')


def test_the_docs_show_the_commands_of_every_subcommand():
    shown = " ".join(commands())
    for name in ("check", "verify", "explain", "export", "run", "audit"):
        assert f"dspatch {name}" in shown, name
    assert len(commands()) > 20


@pytest.mark.parametrize("command", sorted(commands()))
def test_a_command_the_docs_show_runs_as_written(command, tmp_path):
    if "accelerate launch" in command or command.startswith(("DSPATCH=1 deepspeed", "DSPATCH=1 torchrun")):
        pytest.skip("a launcher: no stack here")
    _fixtures(tmp_path)
    bin_dir = os.path.dirname(sys.executable)
    env = clean_env(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    line = fill(command).replace("python3 -m", "python -m")
    proc = subprocess.run(["bash", "-c", line], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    said = proc.stdout + proc.stderr
    if command.startswith("dspatch canary") and "not installed for" in proc.stderr:
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, said  # it needs a stack: said so
        return
    if command in REFUSED:
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "trained" not in proc.stdout, said
        return
    assert proc.returncode in (0, 1, 5), (line, proc.returncode, said[-2000:])
    assert "usage:" not in proc.stderr and "Traceback" not in proc.stderr, (line, said[-2000:])

"""`python -m dspatch`: the `dspatch` command (dspatch.cli)."""
from dspatch.cli import run

run()

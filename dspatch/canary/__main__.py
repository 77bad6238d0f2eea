"""`python -m dspatch.canary CONFIG`: the `dspatch canary` command."""
from dspatch import term
from dspatch.canary import main

term.exit_with(main)

from dspatch import term
from dspatch.audit import main

term.exit_with(main)

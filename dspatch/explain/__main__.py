from dspatch import term
from dspatch.explain import main

term.exit_with(main)

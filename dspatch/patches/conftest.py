"""The harness's fixtures (tests/conftest.py) for the patches' own tests, which live in their folders. Its hooks
(markers, skips, the sessions' selection) are not copied, or they would run twice: run a patch's tests together with
tests/ collected, as every session does (`pytest tests dspatch/patches/<package>/<name> -k ...`, or the folder
with tests/conftest.py loaded: `pytest -p conftest dspatch/patches/...`). Not shipped in the wheel."""
from conftest import _stack_is_complete, deepspeed_copy, package_copy  # noqa: F401

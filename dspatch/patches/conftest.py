"""The harness's fixtures (tests/conftest.py) for the patches' own tests, which live in their folders. Its hooks
need no copy: pytest calls them for every test. Not shipped in the wheel."""
from conftest import _stack_is_complete, deepspeed_copy, package_copy  # noqa: F401

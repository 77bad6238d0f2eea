"""Patches for accelerate: one folder each (see dspatch/patches/__init__.py)."""

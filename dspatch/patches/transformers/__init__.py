"""Patches for transformers: one folder each (see dspatch/patches/__init__.py)."""

"""Patches for trl: one folder each (see dspatch/patches/__init__.py)."""

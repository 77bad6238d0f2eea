"""Patches for deepspeed: one folder each (see dspatch/patches/__init__.py)."""

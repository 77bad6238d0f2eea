"""The patches: one folder each, `<package>/<name>/`, named after the patch's id (`deepspeed/zero3-module-id` lives
in `deepspeed/zero3_module_id/`). The registry (dspatch.registry) finds them by walking these folders: there is no
list to keep.

A patch's folder holds everything about it except its upstream diffs (upstream_prs/) and its generated page (docs/):
- `__init__.py`: the fix, and `PATCH` (a dspatch.spec.Patch); imports nothing heavy at module level;
- `reproducers.py`: its real-upstream scenarios and `PROOF` (a dspatch.spec.Proof), read by `dspatch verify` and the
  tests;
- `test_<name>.py` (optional): its own tests; `logs/` (optional): real logs of the bug, for `dspatch explain`'s
  tests. Neither ships in the wheel.

Modules at this level (`engine_handover`, `scheduler_param_groups`) are helpers that several fixes share.
"""

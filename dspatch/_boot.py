"""Start-up hook, run from dspatch.pth only when DSPATCH is set (to anything but an off word).

It must stay cheap: standard library only, no file reads. It puts dspatch._hook's finder at the front of
sys.meta_path; only when a module of a watched package finishes executing is the patch machinery
(dspatch._runtime, wrapt) imported. Packages imported before this hook are handled by the runtime at
activation. This is the top of dspatch's dependency graph: nothing in dspatch imports it.
"""
import os
import sys

from dspatch import _hook


def _notify(name):
    try:
        from dspatch import _runtime
    except Exception as e:
        _hook.report_failure(name, e)
        return
    _runtime.notify(name)


def install():
    """Called by dspatch.pth. Never raises into `site` (which would print and carry on regardless): a
    failure is reported, and with DSPATCH_STRICT=1 it ends the process, as an error at import would."""
    _hook.install(_notify)
    if any(name in sys.modules for name in _hook.WATCHED):
        # Something imported a target before us (another .pth): let the runtime catch up now.
        try:
            from dspatch import _runtime

            _runtime.activate(None, None)
        except Exception as e:
            print(f"dspatch: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if _hook.strict():  # `site` would only print and go on: end the process as a failed import would
                os._exit(2)

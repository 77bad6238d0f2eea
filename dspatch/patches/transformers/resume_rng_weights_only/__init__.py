"""`Trainer.train(resume_from_checkpoint=...)` on torch >= 2.6: the checkpoint's RNG state loads again.

`Trainer._load_rng_state` reads `rng_state.pth` (`rng_state_{rank}.pth` with several processes) with a bare
`torch.load`. The file holds `np.random.get_state()`: a numpy array and its dtype. torch 2.6 made `weights_only=True`
the default of `torch.load`, which refuses those globals, so on transformers 4.38.0-4.46.3 every resume fails before its
first step, with or without DeepSpeed: `_pickle.UnpicklingError: Weights only load failed ... Unsupported global: GLOBAL
numpy._core.multiarray._reconstruct` (numpy 1.x: `numpy.core.multiarray._reconstruct`). Issue 34631; fixed in 4.47.0 (PR
34632). Nothing else in the Trainer's resume path refuses on torch 2.13 (optimizer, scheduler, weights, state JSON;
DeepSpeed's own load on deepspeed <= 0.15.4 is deepspeed/checkpoint-weights-only).

The fix does what 4.47 does: `_load_rng_state` runs with exactly the globals such a file needs allowed
(`torch.serialization.safe_globals`: numpy's array reconstructor, `ndarray`, `dtype` and the uint32 dtype's class), so
the load stays weights-only: a file that holds anything else is still refused, and so is every other `torch.load` of the
process, the user's own included, which keeps torch's default (the allowance is a context around this one function; a
reproducer checks both). A file written under numpy 1.x and read under numpy 2.x names the old module and is refused, as
on 4.47+.

Target: `Trainer._load_rng_state`, wrapped (once per resume). Proven on the old and bridge stacks: the resumed run's
losses equal an uninterrupted run's bit for bit (dropout on, so the restored RNG shows).
"""
from dspatch.spec import Patch, Signature

PID = "transformers/resume-rng-weights-only"
LOAD = ("transformers.trainer", "Trainer._load_rng_state")
# every release 4.38.0-4.46.3 (4.47.0 loads under safe_globals)
FINGERPRINTS = {LOAD: {"86edbaaae7ed25a9": "4.38.0-4.38.2", "4587f6cda8179daa": "4.39.0-4.39.3",
                       "2a0e528d7b0d9d68": "4.40.0-4.44.2", "48f5be2d0c391441": "4.45.0-4.46.3"}}


def rng_state_globals():
    """What a pickled `np.random.get_state()` needs: the array reconstructor, ndarray, dtype, the uint32 dtype's
    class."""
    import numpy

    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, numpy.ndarray, numpy.dtype, type(numpy.dtype(numpy.uint32))]


def _load_rng_state(wrapped, instance, args, kwargs):
    import torch

    with torch.serialization.safe_globals(rng_state_globals()):
        return wrapped(*args, **kwargs)


def apply(txn):
    txn.wrap(txn.target(LOAD[1]), _load_rng_state)


PATCH = Patch(
    id=PID,
    summary=("resume_from_checkpoint works on torch >= 2.6: the Trainer's RNG state loads with the numpy globals "
             "it needs allowed, still weights-only (no `Weights only load failed` in _load_rng_state)"),
    cause="torch >= 2.6 loads weights-only by default, and the Trainer's RNG state holds numpy objects",
    symptom="`UnpicklingError: Weights only load failed` in `_load_rng_state` on every resume",
    distribution="transformers",
    affected="<4.47.0",
    fixed_in="4.47.0",
    requires={"torch": ">=2.6"},
    supported=">=4.38.0",
    fixed_marker=("transformers.trainer", "safe_globals"),  # upstream's allowlist, module-level from 4.47.0
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/transformers/issues/34631",
           "https://github.com/huggingface/transformers/pull/34632"),
    diffs=("transformers/0006-resume-rng-weights-only-4.38.0-4.46.3.patch",),
    # the refusal of any torch.load: the Trainer's RNG load's own frame decides (torch prints bold escapes inside
    # the first sentence, hence its first words only)
    signatures=(Signature(r"Weights only load failed", error="UnpicklingError",
                          needs=(r"_load_rng_state|checkpoint_rng_state = torch\.load",)),),
    note="Trainer._load_rng_state is wrapped: the numpy globals of an RNG state are allowed for that one load",
)

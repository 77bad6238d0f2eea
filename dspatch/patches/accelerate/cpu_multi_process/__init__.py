"""Ranks started without `--cpu` on a machine without an accelerator know each other again (accelerate 1.13.0-1.15.0).

`PartialState._prepare_backend` decides the distributed type. accelerate 1.13.0 (PR 3883, "Remove ipex") made its
multi-CPU branch require `cpu=True`: ranks that torchrun, the `deepspeed` launcher or `accelerate launch` start on a
machine with no accelerator, without `--cpu` (or `use_cpu=True` in TrainingArguments, which defaults to False), each
get `DistributedType.NO`, and `PartialState` sets itself as process 0 of 1, even after a process group of several
ranks exists. Silently: no rank shards the data (each trains on all of it), nothing syncs gradients outside
DeepSpeed, every rank is the main process and writes the checkpoints; `Accelerator` with DeepSpeed on two CPU ranks
fails. accelerate 1.12 and earlier gave those ranks `MULTI_CPU` (gloo). Open upstream.

The fix gives back 1.12's answer where it is the only one: when `_prepare_backend` found no distributed type, was not
told `cpu`, the environment describes several processes, and torch sees no accelerator, it answers as it does with
`cpu=True` (`MULTI_CPU`, gloo or MPI). A machine with an accelerator, a single process and an explicit `cpu=True` get
upstream's answer unchanged.

Proof: two gloo ranks on the latest stack: `PartialState()` is process 0 and 1 of 2 (one main process), and a Trainer
gives the two ranks disjoint halves of the rows; on accelerate 1.10.1 (mid) stock does the same.
"""
from dspatch.spec import Patch

STATE = "accelerate.state"
PREPARE = "PartialState._prepare_backend"
# every release 1.13.0-1.15.0 (python tests/upstream_releases.py accelerate/cpu-multi-process 1.13.0 1.15.0)
FINGERPRINTS = {(STATE, PREPARE): {"493ae6e606df568d": "1.13.0", "5a11313d3ddaddbf": "1.14.0-1.15.0"}}
SIZES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "WORLD_SIZE")


def _several_processes():
    """The launcher's environment describes a job of several processes (as _prepare_backend itself reads it)."""
    import os

    if int(os.environ.get("LOCAL_RANK", -1)) != -1:
        return True
    return any(int(os.environ.get(name, 1) or 1) > 1 for name in SIZES)


def _accelerator_seen():
    import torch

    found = getattr(torch, "accelerator", None)  # torch >= 2.6: CUDA, XPU, MPS, HPU, ... alike
    return found.is_available() if found is not None and hasattr(found, "is_available") else torch.cuda.is_available()


def cpu_ranks(wrapped, instance, args, kwargs):
    """_prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None) -> (backend, distributed type)."""
    from accelerate.utils import DistributedType

    backend, kind = wrapped(*args, **kwargs)
    cpu = args[0] if args else kwargs.get("cpu", False)
    if kind == DistributedType.NO and not cpu and _several_processes() and not _accelerator_seen():
        if args:
            return wrapped(True, *args[1:], **kwargs)
        return wrapped(*args, **{**kwargs, "cpu": True})
    return backend, kind


def apply(txn):
    txn.wrap(txn.target(PREPARE), cpu_ranks)


PATCH = Patch(
    id="accelerate/cpu-multi-process",
    summary=("Ranks launched without --cpu on a machine with no accelerator are MULTI_CPU (gloo) again, as up to "
             "accelerate 1.12: each knows the others"),
    cause=("accelerate 1.13+ makes ranks launched without --cpu on a machine with no accelerator each process 0 of 1, "
           "even inside a process group of several"),
    symptom="CPU ranks each think they are process 0 of 1: no data sharding, no gradient sync, every rank saves",
    canary=("unsharded",),  # dspatch canary --ranks 2 with the Trainer or an accelerate loop
    distribution="accelerate",
    affected=">=1.13.0",
    fixed_in=None,
    supported=">=1.13.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/accelerate/pull/3883",),
    diffs=("accelerate/0006-cpu-multi-process-1.13.0-1.15.0.patch",),
)

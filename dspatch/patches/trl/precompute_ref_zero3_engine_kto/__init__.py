"""KTO with a precomputed reference at ZeRO-3: the reference pass's engine forgets its trace once its forwards are done.

KTOTrainer's twin of trl/precompute-ref-zero3-engine (DPO): the same bug, cause and fix, in
`KTOTrainer._precompute_ref_logps` (trl 1.9.0-1.16.0, open upstream). KTO with `precompute_ref_log_probs=True` and no
`ref_model` computes the reference through a DeepSpeed inference engine on the policy and keeps it; at ZeRO-3, when the
reference pass took a single batch, the first training forward fails with `IndexError: pop from an empty deque`. When
the pass ends, the patch invalidates the kept engine's trace so that the next forward records one afresh
(`_precompute_ref_logps` wrapped: once per pass, nothing per step). The full story, the proofs and the decisions are on
trl/precompute-ref-zero3-engine's page; both trainers share one upstream diff.

Its own patch because a patch applies once all its modules are imported, and a KTO job never imports the DPO trainer
(nor a DPO job the KTO one).
"""
from dspatch.patches.trl.precompute_ref_zero3_engine import PATCH as DPO_PATCH
from dspatch.patches.trl.precompute_ref_zero3_engine import KTO_FINGERPRINTS, apply, signature
from dspatch.spec import Patch

PATCH = Patch(
    id="trl/precompute-ref-zero3-engine-kto",
    summary=("KTO with precompute_ref_log_probs under ZeRO-3: the reference pass's engine forgets its trace when the "
             "pass ends, so the training forward does not complete it with renumbered modules (no `pop from an "
             "empty deque`)"),
    cause=("KTO's reference pass at ZeRO-3 leaves a recorded module order behind that the training forward "
           "cannot follow"),
    symptom="`IndexError: pop from an empty deque` in the first training forward",
    distribution="trl",
    affected=DPO_PATCH.affected,
    fixed_in=None,
    supported=DPO_PATCH.supported,
    targets=KTO_FINGERPRINTS,
    apply=apply,
    links=DPO_PATCH.links,
    diffs=DPO_PATCH.diffs.values(),  # one upstream change for both trainers
    signatures=(signature(r"trl[/\\]trainer[/\\]kto_trainer\.py"),),
    note="KTOTrainer._precompute_ref_logps is wrapped: once per reference pass, nothing per step",
)

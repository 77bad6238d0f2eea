"""Leaving `deepspeed.zero.Init` no longer gives a class that only inherits `__init__` the `__init__` of an ancestor.

While `zero.Init` is active, every `nn.Module` subclass that defines its own `__init__` runs it wrapped (0.15.1, PR
6388, stopped wrapping the others), the original kept in `cls._old_init`. Leaving it (`__exit__`, and
`deepspeed.initialize`, which shuts the context down) puts `cls.__init__ = cls._old_init` back on every subclass that
*has* an `_old_init`, an inherited one included: a class with no `__init__` of its own gets its nearest wrapped
ancestor's written into its `__dict__`, which now comes before anything between them in its MRO. transformers 4.54+
builds its sequence-classification (and token, QA) heads that way:
`LlamaForSequenceClassification(GenericForSequenceClassification, LlamaPreTrainedModel)` has no `__init__`; the mixin's,
which makes `model` and `score`, is not an `nn.Module`'s. After the first `zero.Init` exit of a process, every such
model built is empty: 0 parameters, the checkpoint's weights "not used". A reward model loaded under ZeRO-3 then fails
when DeepSpeed wraps it, or trains nothing. Found by the no-harm matrix: GRPO with a reward model at ZeRO-3 on the mid
stack (deepspeed 0.16.3, transformers 4.57.6) fails on stock with `IndexError: list index out of range` in
`parameter_offload.py` (the empty reward model wrapped by DeepSpeed). deepspeed 0.15.1-0.17.5; fixed in 0.17.6 (PR
7566).

The fix, upstream's: the exit restores `__init__` only on the classes that define one. `unpatch_init_and_builtins` is
rebuilt from the installed source with that condition added (`'__init__' in cls.__dict__`), nothing per call. A class
already damaged in the process before the patch applied stays damaged: with `DSPATCH=1` the patch applies when deepspeed
is imported, before any `zero.Init` exits. Proven on the mid and bridge stacks with a model class of that shape (no
transformers needed), and by the matrix's GRPO cell on mid.
"""
from dspatch.spec import Patch, Signature

PID = "deepspeed/zero-init-inherited-init"
UNPATCH = ("deepspeed.runtime.zero.partition_parameters", "InsertPostInitMethodToModuleSubClasses.unpatch_init_and_builtins")
# every release 0.15.1-0.17.5 (0.15.0 wraps and restores every subclass alike; 0.17.6 is fixed)
FINGERPRINTS = {UNPATCH: {"68c25840c79f43a8": "0.15.1-0.17.0", "f16a291b63e8a617": "0.17.1-0.17.5"}}


def own_init_only(definition):
    """Transform: `if hasattr(cls, '_old_init'):` in `_disable_class` -> `if '__init__' in cls.__dict__ and
    hasattr(cls, '_old_init'):`."""
    from dspatch.rewrite import expression, find_statement

    block, index = find_statement(definition, "if hasattr(cls, '_old_init'):\n    cls.__init__ = cls._old_init")
    test = block[index].test
    block[index].test = expression("'__init__' in cls.__dict__ and hasattr(cls, '_old_init')", test)


def apply(txn):
    txn.recode(txn.target(UNPATCH[1]), own_init_only)


PATCH = Patch(
    id=PID,
    summary=("leaving zero.Init gives a class that only inherits __init__ (transformers 4.54+'s Generic* heads) "
             "no ancestor's __init__: later models of that class are built whole (no empty reward model)"),
    cause="Leaving `zero.Init` restores an ancestor's `__init__` onto classes that only inherit it",
    symptom="models whose class only inherits `__init__` built empty; `list index out of range`",
    distribution="deepspeed",
    affected=">=0.15.1,<0.17.6",
    fixed_in="0.17.6",
    supported=">=0.15.1",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/7566", "https://github.com/deepspeedai/DeepSpeed/pull/6388"),
    diffs=("deepspeed/0012-zero-init-inherited-init-0.15.1-0.17.5.patch",),
    # what DeepSpeed wraps next: the empty model's first parameter (a reward model in GRPO, or any model loaded
    # under ZeRO-3 and passed to deepspeed.initialize); the DeepSpeed frame alone is not this bug, a list of a model's
    # parameters can be empty for other reasons: offered, named with the warning of the weights left unused
    signatures=(Signature(r"list index out of range", error="IndexError",
                          needs=(r"parameter_offload\.py.*\b(__init__|_convert_to_zero_parameters)\b|"
                                 r"list\(module\.parameters\(\)\)\[0\]",),
                          hints=(r"Some weights of the model checkpoint .* were not used|were not used when "
                                 r"initializing \w+For(Sequence|Token)Classification",),
                          also="a model with no parameters of its own given to deepspeed.initialize"),),
    note=("InsertPostInitMethodToModuleSubClasses.unpatch_init_and_builtins keeps its object, name and line numbers "
          "but runs code rebuilt from the installed file that restores __init__ only on classes that define one"),
)

"""Sequence- and token-classification heads train with gradient accumulation as without it (transformers 4.49-5.24).

Since 4.47 (PR 34915) the Trainer decides that a model "accepts loss kwargs" when its class says
`accepts_loss_kwargs` or, failing that, when its `forward` takes `**kwargs`; for such a model it leaves the division
of the loss by the gradient-accumulation steps to the model (which is then given `num_items_in_batch`), passes
`scale_wrt_gas=False` to DeepSpeed (4.49+) and multiplies the loss by the number of processes when tokens are
averaged across devices (on by default from 4.54). That is right for causal-LM heads, which sum their loss over
`num_items_in_batch`. Sequence- and token-classification heads that take `**kwargs` compute a mean per micro-batch
and never use `num_items_in_batch` (no such head passes it to its loss in any release): their loss and gradients come
out GA times too large (and times the number of processes), silently, with or without DeepSpeed. Read from every
release 4.47.0-5.24.0: `GenericForSequenceClassification`/`GenericForTokenClassification` (4.54+, the Llama, Qwen,
Mistral, Gemma, Phi ... heads), ModernBert's (4.48+), BERT and its family from 5.0 (their forward took no `**kwargs`
before), 237 head classes in 5.24.0. Bloom's heads raise instead (`Got unexpected arguments: {'num_items_in_batch':
...}`, 4.48.1-4.57.6). Open upstream (transformers issue 47688; PRs 47690 and 47836 closed unmerged); upstream's own
answer for single models is the class attribute `accepts_loss_kwargs = False` (ConvNext, PR 40746; Esm, 4.57.1).

The fix: after `Trainer.__init__`, a model whose class (under accelerate's and PEFT's wrappers) is a
`*ForSequenceClassification` or `*ForTokenClassification` and does not say `accepts_loss_kwargs` itself is treated as
not accepting loss kwargs, as such a class attribute would make it: the Trainer divides its loss by the accumulation
and does not scale it by the processes. A class that sets the attribute (Esm's heads, a user's own) is left as it
says.

Not covered: 4.48.x, where DeepSpeed already divides these heads once and the Trainer's division would be a second
(ModernBert without DeepSpeed is hit there); 4.47.x, where every model with a mean loss is GA times too large without
DeepSpeed (another bug, fixed in 4.48.0). Other heads with `**kwargs` and a mean loss (multiple choice, image
classification) are not read here.

Proof: on mid (4.57.6) and latest (5.24.0), the same global batch of 4 rows at GA 1, 2 and 4, one SGD step: stock's
update and logged loss are 1, 2 and 4 times GA 1's for Llama's sequence and token heads (and BERT's on 5.x), with and
without DeepSpeed; patched they equal GA 1's.
"""
import re

from dspatch.spec import Patch

TRAINER = "transformers.trainer"
INIT = "Trainer.__init__"
# every release 4.49.0-5.24.0 (python tests/upstream_releases.py transformers/classification-heads-grad-accum 4.49.0
# 5.24.0)
FINGERPRINTS = {(TRAINER, INIT): {
    "480c53f7b2a97823": "4.49.0", "d2205b02e27c59fe": "4.50.0-4.50.3", "38d895a33ce15208": "4.51.0-4.51.3",
    "58cf8c0085f43e0c": "4.52.1-4.52.4", "013ffc9b3e061908": "4.53.0-4.53.3", "b86b63883d9c9b46": "4.54.0-4.54.1",
    "c7ac7ce7d8a0ab80": "4.55.0-4.55.4", "48b840a68ecbcd51": "4.56.0-4.56.2", "a804eadb5160d54e": "4.57.1-4.57.6",
    "9f935e13e552d6cf": "5.0.0", "26c883d93b200360": "5.1.0", "0475b034aa52e2b7": "5.2.0",
    "07e5791ab7eb3ffd": "5.3.0-5.9.0", "d013b15db51a0282": "5.10.1-5.14.1", "9f2fa973106939de": "5.15.0-5.16.1",
    "2a0393256c6be5d7": "5.17.0", "617100629fea1251": "5.18.0", "3dcf3ab262a3896e": "5.19.0-5.24.0"}}
HEAD = re.compile(r"For(Sequence|Token)Classification$")


def mean_loss_head(model):
    """Whether `model`, under accelerate's and PEFT's wrappers, is a classification head whose class does not say
    whether it accepts loss kwargs."""
    base = getattr(model, "get_base_model", None)  # a PEFT model, as the Trainer unwraps it
    if callable(base):
        model = base()
    cls = type(model)
    return bool(HEAD.search(cls.__name__)) and not any("accepts_loss_kwargs" in vars(c) for c in cls.__mro__)


def heads_divided(wrapped, instance, args, kwargs):
    """Trainer.__init__: a mean-loss classification head does not accept loss kwargs."""
    result = wrapped(*args, **kwargs)
    if getattr(instance, "model_accepts_loss_kwargs", False):
        model = instance.model
        unwrap = getattr(getattr(instance, "accelerator", None), "unwrap_model", None)
        if mean_loss_head(unwrap(model) if unwrap and model is not None else model):
            instance.model_accepts_loss_kwargs = False
    return result


def apply(txn):
    txn.wrap(txn.target(INIT), heads_divided)


PATCH = Patch(
    id="transformers/classification-heads-grad-accum",
    summary=("Trainer: sequence- and token-classification heads with a mean loss are divided by the gradient "
             "accumulation (and not multiplied by the processes), as without **kwargs"),
    cause=("The Trainer leaves the division by the accumulation to any model whose forward takes **kwargs, and "
           "classification heads that take them compute a mean per micro-batch"),
    canary=('not_divided',),
    symptom="classification heads' loss and gradients silently GA (x processes) times too large",
    distribution="transformers",
    affected=">=4.49.0",
    fixed_in=None,
    supported=">=4.49.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/transformers/issues/47688",
           "https://github.com/huggingface/transformers/pull/40746"),
    diffs=("transformers/0008-classification-heads-grad-accum-4.49.0-4.52.4.patch",
           "transformers/0008-classification-heads-grad-accum-4.53.0-4.57.6.patch",
           "transformers/0008-classification-heads-grad-accum-5.0.0-5.1.0.patch",
           "transformers/0008-classification-heads-grad-accum-5.2.0-5.24.0.patch"),
)

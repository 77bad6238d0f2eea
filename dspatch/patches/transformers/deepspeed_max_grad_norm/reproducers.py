"""Reproducers: one step of the real Trainer at ZeRO-2 on a tiny Llama, plain SGD at rate 1, so that the weights move
by exactly the gradient DeepSpeed applied: its norm is the clipping at work. DeepSpeed's config sets no
`gradient_clipping` (as many published configs) unless a scenario says.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

RATE = 1.0


def _model():
    from dspatch.scenario import tiny_llama

    return tiny_llama(initializer_range=0.2)  # gradients well above a norm of 1 at the first step


def _rows():
    """Four rows of eight tokens, the first label of each left out: the Trainer's count of the tokens a loss is divided
    by (labels that are not -100) then equals the tokens the shifted loss scores (4.46-4.57 count the unshifted ones),
    so plain torch's mean loss is the Trainer's."""
    from dspatch.scenario import lm_rows

    return [{"input_ids": row["input_ids"], "labels": [-100] + row["labels"][1:]} for row in lm_rows(4, 8)]


def _step(max_grad_norm, clipping=None):
    """The norm of the weights' move in one Trainer step."""
    import torch

    from dspatch.scenario import init_deepspeed, sgd_trainer, weights

    init_deepspeed()
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "steps_per_print": 10**6, "zero_optimization": {"stage": 2}}
    if clipping is not None:
        config["gradient_clipping"] = clipping
    model = _model()
    before = weights(model)
    sgd_trainer(model, _rows(), config, batch=4, accumulation=1, steps=1, lr=RATE, max_grad_norm=max_grad_norm)
    after = weights(model)
    return torch.sqrt(sum(((after[name] - before[name]).double() ** 2).sum() for name in before)).item()


def _gradient_norm():
    """The norm of the same step's gradient, in plain torch: the same model and rows, one batch of all four."""
    import torch

    model = _model()
    rows = _rows()
    ids, labels = (torch.tensor([row[key] for row in rows]) for key in ("input_ids", "labels"))
    model(input_ids=ids, labels=labels).loss.backward()
    return torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()


def _close(got, want):
    return abs(got - want) <= 1e-4 * max(abs(want), 1e-12)


def clips_at_max_grad_norm():
    """A Trainer step with max_grad_norm=0.01 and no gradient_clipping in the config moves the weights by 0.01 (SGD at
    rate 1: the clipped gradient)."""
    moved, norm = _step(0.01), _gradient_norm()
    if norm <= 0.01:
        raise AssertionError(f"the gradient's norm {norm} is not above the clipping: the scenario shows nothing")
    if not _close(moved, RATE * 0.01):
        raise BugSeen(f"max_grad_norm=0.01 ignored under DeepSpeed: the weights moved by {moved:.6g} (the gradient's "
                      f"norm {norm:.6g}), not by 0.01")


def no_clipping_when_asked():
    """max_grad_norm=0 (no clipping) and no gradient_clipping in the config: the weights move by the whole gradient."""
    moved, norm = _step(0.0), _gradient_norm()
    if norm <= 1.0:
        raise AssertionError(f"the gradient's norm {norm} is not above DeepSpeed's default clipping of 1.0")
    if not _close(moved, RATE * norm):
        raise BugSeen(f"max_grad_norm=0 ignored under DeepSpeed: the weights moved by {moved:.6g}, the gradient's "
                      f"norm is {norm:.6g} (clipped at DeepSpeed's own default)")


def explicit_clipping_kept():
    """A config that sets gradient_clipping (0.05, as max_grad_norm) clips there, as on stock."""
    moved = _step(0.05, clipping=0.05)
    if not _close(moved, RATE * 0.05):
        raise AssertionError(f"gradient_clipping=0.05: the weights moved by {moved:.6g}, not by 0.05")


PROOF = Proof(
    scenarios={"clips_at_max_grad_norm": clips_at_max_grad_norm, "no_clipping_when_asked": no_clipping_when_asked,
               "explicit_clipping_kept": explicit_clipping_kept},
    expected_on_stock={"clips_at_max_grad_norm": "max_grad_norm=0.01 ignored under DeepSpeed",
                       "no_clipping_when_asked": "max_grad_norm=0 ignored under DeepSpeed"},
    # deepspeed before 0.19.3 does not clip without the key: max_grad_norm=0 then happens to be obeyed
    stock_fails_on={"no_clipping_when_asked": {"deepspeed": ">=0.19.3"}},
    silent="the run trains without an error, clipped otherwise than max_grad_norm says",
    releases_checked=("4.44.0", "5.24.0"),
)

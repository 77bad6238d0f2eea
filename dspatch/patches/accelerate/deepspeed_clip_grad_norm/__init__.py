"""`accelerator.clip_grad_norm_(params, max_norm)` under DeepSpeed clips at `max_norm` from the next optimizer step on
(accelerate, every release; open upstream).

Stock ignores `max_norm`: the call returns the engine's norm (None before 1.8) and DeepSpeed clips at its config's
`gradient_clipping`, whatever the loop asked for.

A silent one: no error, no warning. Under DeepSpeed, accelerate's `clip_grad_norm_` only reads the gradient norm back,
because DeepSpeed clips inside its own step. What it clips at is the config's `gradient_clipping`: accelerate fills
"auto" with 1.0, and a config without the key clips at nothing before deepspeed 0.19.3 and at 1.0 from it (DeepSpeed
PR 8068). A custom loop with `accelerator.clip_grad_norm_(model.parameters(), 0.01)` trains unclipped, or clipped at
1.0, a hundred times the norm asked for (accelerate issues 3509 and 3807, DeepSpeed issues 7220 and 6743; the custom-loop
twin of transformers/deepspeed-max-grad-norm). Measured: SGD at rate 1 with max_norm 0.01 moves the weights by the
whole gradient (update norms 12-113) on deepspeed 0.16 and by 1.0 on 0.19.8.

The fix: the call tells the engine the `max_norm` asked for, where DeepSpeed keeps its clipping (the config's
`gradient_clipping`, which the engine reads at ZeRO-0 in fp32, and the `clip_grad` of its ZeRO, bf16 or fp16
optimizer), and returns what stock returns. DeepSpeed steps inside `accelerator.backward`, before the call, so the
first step a loop takes has already run at the config's value: from the next step on, `max_norm` is what is applied,
and one warning line says which step it took effect at and what the steps before clipped at. It leaves alone:
a `max_norm` equal to the engine's clipping (nothing to change, to the bit: the Trainer's call, whose
max_grad_norm fills the config's "auto"); a `max_norm` of inf (how the Trainer reads the norm alone); a `norm_type` other than 2 (DeepSpeed
clips by the 2-norm only: one warning says so); an optimizer that keeps no `clip_grad` (one warning: not applied);
ZeRO-1/2 with `compute_grad_norm: false` and a `max_norm` above 0 (DeepSpeed refuses clipping without the norm).

Proven by numbers on the old, bridge, mid and latest stacks: an accelerate loop of 3 steps at ZeRO-0, ZeRO-2 and ZeRO-3,
SGD at rate 1, config clipping 1.0 and `max_norm` 0.01: the first step clipped at 1.0 and the next two at 0.01, as
plain torch does with those values (relative 1e-5); stock clips all three at 1.0.
"""
from dspatch.spec import Patch

ACCELERATOR = "accelerate.accelerator"
CLIP = "Accelerator.clip_grad_norm_"
FINGERPRINTS = {(ACCELERATOR, CLIP): {"b12b5aaaaafd4c01": "0.34.0-1.5.2", "048366912dc6aafb": "1.6.0-1.7.0",
                                      "f23579b9d4553659": "1.8.0-1.9.0", "8f5a610e5037470c": "1.10.0-1.14.0",
                                      "c6082d221b9aa40d": "1.15.0-1.15.0"}}

_said: set = set()  # the warnings said, once each per process


def _warn(kind, text):
    if kind not in _said:
        _said.add(kind)
        from accelerate.logging import get_logger

        get_logger(ACCELERATOR).warning(f"dspatch (accelerate/deepspeed-clip-grad-norm): {text}", main_process_only=True)


def clip_at(engine, max_norm, norm_type):
    """Make `max_norm` the clipping DeepSpeed applies at `engine`'s next steps (see the module's docstring)."""
    current = float(engine.gradient_clipping() or 0.0)
    if max_norm == current or max_norm == float("inf"):  # inf: the Trainer's way of reading the norm alone
        return
    if float(norm_type) != 2.0:
        _warn("norm", f"accelerator.clip_grad_norm_(norm_type={norm_type}) under DeepSpeed: DeepSpeed clips by the "
                      f"2-norm only; its gradient_clipping {current} is left as it is")
        return
    optimizer = engine.optimizer
    whole_model = not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization())
    if not whole_model and getattr(optimizer, "clip_grad", None) is None:
        _warn("kept", f"accelerator.clip_grad_norm_(max_norm={max_norm}) under DeepSpeed: the engine's optimizer "
                      f"({type(optimizer).__name__}) keeps no clip_grad; it clips at {current} as configured")
        return
    if max_norm > 0 and getattr(optimizer, "compute_grad_norm", True) is False:
        _warn("norm_off", f"accelerator.clip_grad_norm_(max_norm={max_norm}) under DeepSpeed: the config's "
                          f"compute_grad_norm is false, so DeepSpeed cannot clip; gradient_clipping stays {current}")
        return
    engine._config.gradient_clipping = max_norm  # what the engine reads at ZeRO-0 in fp32
    if getattr(optimizer, "clip_grad", None) is not None:
        optimizer.clip_grad = max_norm  # what ZeRO's, bf16's and fp16's optimizers read at each step
    steps = int(getattr(engine, "global_steps", 0) or 0)
    _warn("late", f"accelerator.clip_grad_norm_(max_norm={max_norm}) under DeepSpeed: DeepSpeed clips at it from "
                  f"optimizer step {steps + 1} on; {steps} step{'s' * (steps != 1)} before clipped at {current} (the "
                  f"config's gradient_clipping: DeepSpeed steps inside accelerator.backward, before this call)"
          if steps else f"accelerator.clip_grad_norm_(max_norm={max_norm}) under DeepSpeed: DeepSpeed clips at it "
                        f"(the config's gradient_clipping said {current})")


def clip_grad_norm_asked(wrapped, accelerator, args, kwargs):
    """Accelerator.clip_grad_norm_(self, parameters, max_norm, norm_type=2)."""
    result = wrapped(*args, **kwargs)
    from accelerate.utils import DistributedType

    wrapper = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapper is None or accelerator.distributed_type != DistributedType.DEEPSPEED:
        return result

    def split(parameters, max_norm, norm_type=2):
        return max_norm, norm_type

    max_norm, norm_type = split(*args, **kwargs)
    clip_at(wrapper.engine, float(max_norm), norm_type)
    return result


def apply(txn):
    txn.wrap(txn.target(CLIP), clip_grad_norm_asked)


PATCH = Patch(
    id="accelerate/deepspeed-clip-grad-norm",
    summary=("accelerate + DeepSpeed: accelerator.clip_grad_norm_(params, max_norm) makes DeepSpeed clip at max_norm "
             "from the next step on (one warning says from which), instead of ignoring it (silent)"),
    cause=("Under DeepSpeed, accelerate's clip_grad_norm_ only reads the norm back; DeepSpeed clips at its config's "
           "gradient_clipping, whatever max_norm says"),
    canary=("clip_call",),
    symptom="`max_norm` of accelerator.clip_grad_norm_ silently ignored under DeepSpeed",
    distribution="accelerate",
    affected=">=0",
    fixed_in=None,
    supported=">=0.34.0",
    requires={"deepspeed": ">=0"},
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/accelerate/issues/3509", "https://github.com/huggingface/accelerate/issues/3807",
           "https://github.com/deepspeedai/DeepSpeed/issues/7220"),
    diffs=("accelerate/0010-deepspeed-clip-grad-norm-0.34.0-1.7.0.patch",
           "accelerate/0010-deepspeed-clip-grad-norm-1.8.0-1.15.0.patch"),
    note=("Accelerator.clip_grad_norm_ is wrapped: under DeepSpeed, a max_norm other than the engine's clipping "
          "becomes its clipping for the next steps (one warning line)"),
)

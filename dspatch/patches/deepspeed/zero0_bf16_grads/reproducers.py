"""Reproducers: real deepspeed.initialize with bf16 at ZeRO stage 0 (CPU, one process) on a tiny Llama with SGD: the
raw engine loop and a custom accelerate loop, each against plain torch. A silent bug, proven by numbers.

Plain torch here is what DeepSpeed's mixed precision does: a bf16 model's gradient, copied into fp32 master weights,
an SGD step on those, copied back into the model. The fixed engine loop equals it to the bit on 0.18.2 and 0.18.3
(the same operations in the same order; the tolerance, relative 1e-6, only spares a change of summation order). The
bug moves the weights by tens of percent. Where the numbers differ, the engine loop checks that they are exactly this
bug's (the gradients piled up over steps; on 0.18.3-0.18.5 also divided by 65536) before it says so; any other
difference is an error. Each checks that its run is the one meant (bf16 at stage 0 on the unfused fp16 optimizer).
Not run here: the Trainer (transformers refuses bf16 without a GPU), which the second half hits too.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

STEPS, LR, RTOL = 3, 0.5, 1e-6
SCALE = 2.0 ** 16  # the fp16 optimizer's initial dynamic loss scale, which 0.18.3-0.18.5 divide bf16 gradients by


def _config(stage, **extra):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "gradient_clipping": 0.0,  # an update is the gradient itself
            "zero_allow_untested_optimizer": True, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
            **extra}


def _batches():
    """The micro-batches, where DeepSpeed trains (the CPU here; the GPU under DS_ACCELERATOR=cuda)."""
    from dspatch.scenario import lm_batches, on_accelerator

    return [{key: on_accelerator(value) for key, value in batch.items()} for batch in lm_batches(STEPS)]


def _plain_torch(batches, pile=False, divide=1.0, accumulation=1):
    """The weights (as fp32) after one SGD step per window of `accumulation` micro-batches (each loss divided by it)
    of a bf16 model with fp32 master weights; `pile`: the model's gradients never cleared, `divide`: each step's
    gradient divided by it (the bug's shapes)."""
    import torch

    from dspatch.scenario import lm_loss, on_accelerator, tiny_llama, windows

    model = on_accelerator(tiny_llama().to(torch.bfloat16))
    params = list(model.parameters())
    master = [p.detach().float().clone() for p in params]
    optimizer = torch.optim.SGD(master, lr=LR)
    for window in windows(batches, accumulation):
        for batch, by in window:
            (lm_loss(model, batch) / by).backward()
        for m, p in zip(master, params):
            m.grad = p.grad.to(m.dtype)
            if divide != 1.0:
                m.grad.mul_(1.0 / divide)
            if not pile:
                p.grad = None
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)
    return {name: p.detach().float() for name, p in model.named_parameters()}


def _as_stock_writes_it(engine):
    """The optimizer's state as stock writes it in a checkpoint (dynamic loss scale 65536), loaded back: a resume."""
    state = engine.optimizer.state_dict()
    state.update(dynamic_loss_scale=True, cur_scale=SCALE, last_overflow_iter=-1, scale_factor=2.0, scale_window=1000)
    engine.optimizer.load_state_dict(state)


def _engine_weights(batches, accumulation=1, resume=False):
    """The weights (as fp32) after `engine.backward(loss); engine.step()` on each micro-batch, bf16 at stage 0;
    `resume`: after the first step, the optimizer's state as stock writes it loaded back."""
    import torch

    from dspatch.scenario import init_deepspeed, lm_loss, tiny_llama

    deepspeed = init_deepspeed()
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=_config(0, gradient_accumulation_steps=accumulation))
    if type(engine.optimizer).__name__ != "FP16_UnfusedOptimizer":  # the run is the one meant
        raise AssertionError(f"bf16 at stage 0 built {type(engine.optimizer).__name__}, not FP16_UnfusedOptimizer")
    for step, batch in enumerate(batches):
        if resume and step == 1:
            _as_stock_writes_it(engine)
        engine.backward(lm_loss(engine, batch))
        engine.step()
    return {name: p.detach().float() for name, p in model.named_parameters()}


def _judge(got, batches, where):
    """Nothing where `got` is plain torch's weights, BugSeen where it is this bug's, else an error."""
    from dspatch.scenario import worst

    off = worst(got, _plain_torch(batches))
    if off <= RTOL:
        return
    if worst(got, _plain_torch(batches, pile=True)) <= RTOL:
        raise BugSeen(f"bf16 at ZeRO-0, {where}: each step applied every earlier step's gradient again (weights "
                      f"{off:.0%} off plain torch)")
    if worst(got, _plain_torch(batches, pile=True, divide=SCALE)) <= RTOL:
        raise BugSeen(f"bf16 at ZeRO-0, {where}: each step applied every earlier step's gradient again, divided by "
                      f"the loss scale {SCALE:.0f} (weights {off:.0%} off plain torch)")
    if worst(got, _plain_torch(batches, divide=SCALE)) <= RTOL:  # the second half alone
        raise BugSeen(f"bf16 at ZeRO-0, {where}: each step's gradient divided by the loss scale {SCALE:.0f} (weights "
                      f"{off:.0%} off plain torch)")
    raise AssertionError(f"{where}: weights {off:.2e} off plain torch, and not as this bug piles or divides gradients")


def engine_loop():
    """Three SGD steps of `engine.backward(loss); engine.step()` at bf16 stage 0: plain torch's weights."""
    batches = _batches()
    _judge(_engine_weights(batches), batches, "engine.backward(loss); engine.step()")


def resume():
    """One step, a resume from the state stock writes (its loss scale 65536 in the checkpoint), two more steps: plain
    torch's weights."""
    batches = _batches()
    _judge(_engine_weights(batches, resume=True), batches, "resumed from a stock checkpoint")


def accelerate_loop():
    """Three SGD steps of a custom accelerate loop (`accelerator.backward(loss)`, `optimizer.step()`,
    `optimizer.zero_grad()`) with the DeepSpeed plugin, bf16 at stage 0: plain torch's weights (accelerate's
    `zero_grad` leaves DeepSpeed's gradients to DeepSpeed)."""
    import torch

    from dspatch.scenario import init_deepspeed, lm_loss, reset_accelerate, tiny_llama

    init_deepspeed()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    batches = _batches()
    reset_accelerate()
    try:
        accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_config(0)))
        model = tiny_llama()
        engine, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        ran = (type(engine).__name__, engine.bfloat16_enabled(), type(engine.optimizer).__name__)
        if ran != ("DeepSpeedEngine", True, "FP16_UnfusedOptimizer"):
            raise AssertionError(f"accelerate prepared (engine, bf16, optimizer) {ran}")
        for batch in batches:
            accelerator.backward(lm_loss(engine, batch))
            optimizer.step()
            optimizer.zero_grad()
    finally:
        reset_accelerate()
    _judge({name: p.detach().float() for name, p in model.named_parameters()}, batches, "a custom accelerate loop")


def grad_norm():
    """The grad norm DeepSpeed reports after the first step at bf16 stage 0 (what the Trainer logs) is plain torch's:
    the norm of the first micro-batch's bf16 gradient (relative 1e-3: DeepSpeed sums the squares per group)."""
    import torch

    from dspatch.scenario import init_deepspeed, lm_loss, on_accelerator, tiny_llama

    batch = _batches()[0]
    model = on_accelerator(tiny_llama().to(torch.bfloat16))
    lm_loss(model, batch).backward()
    want = float(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()])))
    deepspeed = init_deepspeed()
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=_config(0))
    engine.backward(lm_loss(engine, batch))
    engine.step()
    got = float(engine.get_global_grad_norm())
    if abs(got - want) <= 1e-3 * want:
        return
    if abs(got / want / SCALE - 1) <= 1e-3:
        raise BugSeen(f"bf16 at ZeRO-0: the reported grad norm {got:.6g} is the loss scale {SCALE:.0f} times the "
                      f"gradient's {want:.6g}")
    raise AssertionError(f"the reported grad norm {got:.6g} is not the gradient's {want:.6g}, nor this bug's")


PROOF = Proof(
    scenarios={"engine_loop": engine_loop, "accelerate_loop": accelerate_loop, "grad_norm": grad_norm, "resume": resume},
    expected_on_stock={"engine_loop": "each step applied every earlier step's gradient again",
                       "resume": "resumed from a stock checkpoint: each step applied every earlier step's gradient",
                       "accelerate_loop": "each step applied every earlier step's gradient again",
                       "grad_norm": "the reported grad norm"},
    # 0.18.3-0.18.5 compute the norm from the gradients backward left unscaled: right at the first step
    stock_fails_on={"grad_norm": "<0.18.3"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.17.5", "0.18.6"),
    silent="gradients piled up or divided by the loss scale, no message: proven by numbers",
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0183", "ds0182"),
)

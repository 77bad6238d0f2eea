"""Reproducers: real deepspeed.initialize (CPU) + torch.utils.checkpoint, and a transformers Trainer with peft.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.scenario import on_accelerator
from dspatch.spec import BugSeen, Proof
from dspatch.patches.deepspeed.zero3_frozen_checkpointing import CHECKPOINT_ERROR


def _model(seed=0):
    """Two checkpointable blocks; each: a frozen norm-like scale on its input (does the input require grad? not
    in the first block: no post-backward hook there), a trainable Linear (the adapter), another frozen scale."""
    import torch

    class Scale(torch.nn.Module):  # an RMSNorm's `weight * hidden`: saves the weight itself for backward
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(8) + 0.5)

        def forward(self, x):
            return x * self.weight

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = Scale()
            self.adapter = torch.nn.Linear(8, 8)
            self.post = Scale()

        def forward(self, x):
            return self.post(torch.tanh(self.adapter(self.pre(x))))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
            self.head = torch.nn.Linear(8, 1)
            self.mode = None  # None: no checkpointing, True: reentrant, False: non-reentrant

        def forward(self, x):
            from torch.utils.checkpoint import checkpoint

            for block in self.blocks:
                x = block(x) if self.mode is None else checkpoint(block, x, use_reentrant=self.mode)
            return self.head(x).pow(2).mean()

    torch.manual_seed(seed)
    net = Net()
    for block in net.blocks:
        block.pre.requires_grad_(False)
        block.post.requires_grad_(False)
    return net


def _checkpoint_error(e):
    if CHECKPOINT_ERROR not in str(e):
        raise e
    return BugSeen(f"CheckpointError: {CHECKPOINT_ERROR} (a frozen weight partitioned during the recompute)")


def train_plain(mode, steps=3, accumulation=1, gathered=None, all_trainable=False):
    """Losses and final parameters of a ZeRO-3 job on _model with checkpointing `mode`. `gathered`: a list that
    gets, after every backward, the names of the parameters still gathered. `all_trainable`: nothing frozen."""
    import torch
    from torch.utils.checkpoint import CheckpointError

    from dspatch.scenario import init_deepspeed, zero3_config

    deepspeed = init_deepspeed()
    net = _model()
    net.mode = mode
    if all_trainable:
        net.requires_grad_(True)
    config = zero3_config(stage3_prefetch_bucket_size=0)
    config["gradient_accumulation_steps"] = accumulation
    engine, *_ = deepspeed.initialize(model=net, config=config,
                                      model_parameters=[p for p in net.parameters() if p.requires_grad])
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps * accumulation):
        x = on_accelerator(torch.randn(2, 8, generator=generator))
        if mode is True:
            x.requires_grad_(True)  # reentrant checkpointing needs an input that requires grad
        loss = engine(x)
        try:
            engine.backward(loss)
        except CheckpointError as e:
            raise _checkpoint_error(e) from e
        if gathered is not None:
            gathered.append({n for n, p in net.named_parameters() if p.ds_status.name != "NOT_AVAILABLE"})
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(net.parameters())):
        final = {n: p.detach().clone() for n, p in net.named_parameters()}
    return losses, final


def _same_as_without_recompute(mode_losses, mode_params, what):
    """Equal = bit-identical: the recompute runs the same ops on the same gathered weights, so the losses and
    the trained parameters of every step equal those of the same job without checkpointing, and of the same
    job with reentrant checkpointing, to the last bit (CPU, deterministic kernels)."""
    import torch

    for mode in (None, True):
        losses, params = train_plain(mode, steps=len(mode_losses))
        if losses != mode_losses or any(not torch.equal(params[n], mode_params[n]) for n in params):
            raise AssertionError(f"{what}: losses {mode_losses} vs {losses} with checkpointing {mode}, or the "
                                 f"parameters differ")


def checkpoint_frozen_weight():
    """deepspeed.initialize + torch.utils.checkpoint(use_reentrant=False) over blocks with frozen weights:
    trains, bit-identical to no checkpointing and to reentrant checkpointing."""
    losses, params = train_plain(False)
    _same_as_without_recompute(losses, params, "non-reentrant")


def accumulation_releases_frozen():
    """The same with 2 micro-batches per step: the recompute's frozen weights are not left gathered after a
    backward (nor across micro-batches) where the same weights, trainable, would be partitioned again. Includes
    the first block, whose input does not require grad (no post-backward hook runs for its first module).

    The yardstick is the same job with every weight trainable (stock hits no bug there), not "nothing gathered":
    some releases keep weights gathered after a non-reentrant backward whether frozen or not (0.16.0-0.16.7 keep
    a recomputed module's count of pending gradients growing, so its post-backward release never runs again;
    a block's first module with an input that needs no grad has no post-backward hook at all)."""
    frozen, trainable = [], []
    train_plain(False, steps=2, accumulation=2, gathered=frozen)
    train_plain(False, steps=2, accumulation=2, gathered=trainable, all_trainable=True)
    names = {n for n, p in _model().named_parameters() if not p.requires_grad}
    extra = [sorted((f - t) & names) for f, t in zip(frozen, trainable) if (f - t) & names]
    if extra:
        raise AssertionError(f"frozen weights left gathered after a backward (trainable ones are not): {extra}")


def trainer_losses(use_reentrant, steps=2):
    """A transformers Trainer on a tiny Llama with a peft LoRA adapter, ZeRO-3 (nothing persistent), gradient
    checkpointing with `use_reentrant`; the logged loss of every step."""
    import tempfile

    from torch.utils.checkpoint import CheckpointError

    from dspatch.scenario import init_deepspeed, lm_rows, reset_accelerate, tiny_llama, train_with_deepspeed

    init_deepspeed()
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    reset_accelerate()
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "steps_per_print": 10**6,
                 # DeepSpeed's own optimizer and scheduler: a torch scheduler over DeepSpeed's optimizer trips
                 # another bug of these stacks (dspatch's accelerate/deepspeed-scheduler-param-groups)
                 "optimizer": {"type": "Adam", "params": {"lr": "auto", "torch_adam": True}},
                 "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto"}},
                 "zero_optimization": {
                     "stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}}
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-2,
                                 logging_steps=1, save_strategy="no", report_to=[], deepspeed=ds_config,
                                 gradient_checkpointing=True,
                                 gradient_checkpointing_kwargs={"use_reentrant": use_reentrant},
                                 dataloader_num_workers=0, seed=0, data_seed=0)
        model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        model.enable_input_require_grads()  # what peft/trl do for checkpointing (reentrant needs it)
        trainer = Trainer(model=model, args=args, train_dataset=lm_rows(steps * 2, 16))
        train_with_deepspeed(trainer, CheckpointError, _checkpoint_error)
        import deepspeed

        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters([p for _, p in trained]):
            params = {n: p.detach().clone() for n, p in trained}
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], params


def trainer_lora_non_reentrant():
    """Trainer + LoRA + ZeRO-3 + gradient_checkpointing_kwargs={"use_reentrant": False}: trains, and its logged
    losses and trained LoRA weights equal (bit for bit) those of the same run with reentrant checkpointing."""
    import torch

    losses, params = trainer_losses(False)
    reentrant, reentrant_params = trainer_losses(True)
    if losses != reentrant or any(not torch.equal(params[n], reentrant_params[n]) for n in params):
        raise AssertionError(f"non-reentrant losses {losses} differ from reentrant {reentrant}, or the trained "
                             f"LoRA weights do")


PROOF = Proof(
    scenarios={"checkpoint_frozen_weight": checkpoint_frozen_weight,
               "accumulation_releases_frozen": accumulation_releases_frozen,
               "trainer_lora_non_reentrant": trainer_lora_non_reentrant},
    expected_on_stock={"checkpoint_frozen_weight": f"CheckpointError: {CHECKPOINT_ERROR}",
                       "accumulation_releases_frozen": f"CheckpointError: {CHECKPOINT_ERROR}",
                       "trainer_lora_non_reentrant": f"CheckpointError: {CHECKPOINT_ERROR}"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
)

"""ZeRO-3 + frozen weights (LoRA, QLoRA) + non-reentrant activation checkpointing trains instead of raising
`CheckpointError: Recomputed values ... have different metadata` (a frozen weight seen with shape [0]).

In backward, torch's non-reentrant checkpoint recomputes a block's forward to get its saved tensors back; that
re-runs ZeRO-3's forward hooks, and the post-hook partitions every parameter of a submodule in place
(`param.data = torch.empty(0)`). torch keeps a live, undetached reference to a saved tensor that does not require
grad (`x.detach() if x.requires_grad else x`): a trainable weight is saved as a detached alias and keeps its
shape, a frozen one is the Parameter itself, so partitioning it shrinks the very tensor the recompute is about to
validate (and that the backward would read). Typical hit: `weight * hidden` in an RMSNorm of a LoRA model
(a frozen Linear saves `weight.t()`, a view, which is not affected). Non-reentrant is the default from
transformers 5.0 and on 4.x whenever `use_reentrant=False` is passed. Fixed upstream in deepspeed 0.19.3
(PR 8148, building on PR 8130).

The fix (PR 8130's rule, which PR 8148 kept): a *forward* release that runs inside a backward pass (a
checkpoint recompute: `torch._C._current_graph_task_id() != -1`) leaves the submodule's frozen parameters
gathered; the backward of that submodule, which runs next, releases them as it releases everything else.
Trainable parameters are released as before (their memory profile is unchanged). Upstream PR 8148 also
releases, at the end of the backward pass, frozen parameters whose submodule backward never ran (a block input
that does not require grad registers no post-backward hook; on 0.16.0-0.16.7 a recomputed module's count of
pending gradients keeps growing, so its post-backward release never runs again); this patch does the same, with a
callback queued once per backward pass on torch's autograd engine, which runs the coordinator's own
`release_sub_module` again for the submodules whose held parameters are still gathered (it drops that submodule's
own mark and releases only what no other submodule uses).

How: one wrapper (wrapt) around `DeepSpeedZeRoOffload.post_sub_module_forward_function`, the forward-release
hook, which is the one place that knows a release is a forward one in every affected release (the coordinator's
`release_sub_module` has a `forward` flag only since 0.17.0). Inside a backward pass only, around the call it
marks the submodule's gathered frozen parameters `is_external_param` (the flag `release_sub_module` already
skips, both in its release and in its fast-sharding buffer swap) and puts the flag back right after. Outside a
backward pass (every ordinary forward) the wrapper only asks torch for the graph task id: nothing else runs, so a
job that does not recompute is bit-identical to stock.

Not the coordinator's code itself: deepspeed/zero3-module-id rebuilds `release_sub_module` (and this hook) from
the installed source on <= 0.16.3, and two rebuilds of one function do not compose (the second would start from
the installed source and drop the first, so dspatch refuses it); a wrapper composes with a rebuild in either
order.
"""
from dspatch.spec import BugSeen, Patch, Target

OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
FORWARD_RELEASE = "DeepSpeedZeRoOffload.post_sub_module_forward_function"

# The forward-release hook's released source, by band (tests/test_gating_zero3_frozen_checkpointing.py
# recomputes them from every sdist).
FINGERPRINTS = {"7afccceb166e3708": "0.14.0-0.15.3", "d7a3471a831c5bc1": "0.15.4-0.16.3",
                "1d6b2192d969f6cb": "0.16.4-0.16.9", "a476dcf9d180069b": "0.17.0-0.18.0",
                "2dc4a478cb2eec93": "0.18.1-0.19.2"}

CHECKPOINT_ERROR = "Recomputed values for the following tensors have different metadata than during the forward pass"

_pending = {}  # autograd graph task id -> {id(submodule): (offload, submodule, [frozen params held])}


def _coordinator(offload, module):
    get = offload.get_param_coordinator
    code = get.__func__.__code__
    if "training" in code.co_varnames[:code.co_argcount]:  # deepspeed <= 0.15.3
        return get(training=module.training)
    return get()


def _release_leftovers(task):
    """End of a backward pass: submodules whose backward never ran (no post-backward hook) still hold the frozen
    parameters the recompute gathered; release them as that backward would have."""
    for offload, module, held in _pending.pop(task, {}).values():
        if any(p.ds_status.name == "AVAILABLE" for p in held):  # (its own id may still mark them in use)
            _coordinator(offload, module).release_sub_module(module)


def hold_frozen_in_recompute(wrapped, instance, args, kwargs):
    import torch

    task = torch._C._current_graph_task_id()
    if task == -1:  # an ordinary forward: exactly upstream's call
        return wrapped(*args, **kwargs)
    module = args[0] if args else kwargs["sub_module"]
    held = [p for p in module.parameters() if not p.requires_grad and hasattr(p, "ds_status")
            and p.ds_status.name == "AVAILABLE" and not p.is_external_param]
    if not held:
        return wrapped(*args, **kwargs)
    for p in held:
        p.is_external_param = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        for p in held:
            p.is_external_param = False
        pending = _pending.get(task)
        if pending is None:
            pending = _pending[task] = {}
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _release_leftovers(task))
        pending[id(module)] = (instance, module, held)


def apply(txn):
    txn.wrap(txn.patch.targets[0], hold_frozen_in_recompute)


# ----------------------------------------------------------------------------------------------------
# Reproducers: real deepspeed.initialize (CPU) + torch.utils.checkpoint, and a transformers Trainer with peft.

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
        x = torch.randn(2, 8, generator=generator)
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


def _tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def trainer_losses(use_reentrant, steps=2):
    """A transformers Trainer on a tiny Llama with a peft LoRA adapter, ZeRO-3 (nothing persistent), gradient
    checkpointing with `use_reentrant`; the logged loss of every step."""
    import tempfile

    import torch
    from torch.utils.checkpoint import CheckpointError

    from dspatch.scenario import init_deepspeed

    init_deepspeed()
    from accelerate.state import AcceleratorState
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    AcceleratorState._reset_state(True)
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
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj",
                                                                                                       "v_proj"]))
        model.enable_input_require_grads()  # what peft/trl do for checkpointing (reentrant needs it)
        generator = torch.Generator().manual_seed(3)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(4, 64, (steps * 2, 16),
                                                                           generator=generator).tolist()]
        trainer = Trainer(model=model, args=args, train_dataset=data)
        if not trainer.is_deepspeed_enabled:
            raise AssertionError("the Trainer did not use DeepSpeed")
        try:
            trainer.train()
        except CheckpointError as e:
            raise _checkpoint_error(e) from e
        finally:
            AcceleratorState._reset_state(True)
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


PATCH = Patch(
    id="deepspeed/zero3-frozen-checkpointing",
    summary=("ZeRO-3 + frozen weights (LoRA) + non-reentrant gradient checkpointing: CheckpointError (a frozen weight "
             "seen with shape [0]); frozen weights stay gathered through the recompute, as upstream since 0.19.3"),
    distribution="deepspeed",
    affected="<0.19.3",
    fixed_in="0.19.3",
    targets=[Target(OFFLOAD, FORWARD_RELEASE, FINGERPRINTS)],
    apply=apply,
    links=("https://github.com/deepspeedai/DeepSpeed/pull/8148", "https://github.com/deepspeedai/DeepSpeed/pull/8130",
           "https://github.com/huggingface/transformers/issues/47254", "https://github.com/huggingface/trl/issues/2514",
           "https://github.com/deepspeedai/DeepSpeed/issues/4332"),
    supported=">=0.14.0",
    # one diff per band of releases whose parameter_offload.py differs around the change (each applies as it is)
    diffs={">=0.14.0,<=0.15.3": "deepspeed/0006-zero3-frozen-checkpointing-0.14.0-0.15.3.patch",
           "==0.15.4": "deepspeed/0006-zero3-frozen-checkpointing-0.15.4.patch",
           ">=0.16.0,<=0.16.3": "deepspeed/0006-zero3-frozen-checkpointing-0.16.0-0.16.3.patch",
           ">=0.16.4,<=0.16.9": "deepspeed/0006-zero3-frozen-checkpointing-0.16.4-0.16.9.patch",
           ">=0.17.0,<=0.18.0": "deepspeed/0006-zero3-frozen-checkpointing-0.17.0-0.18.0.patch",
           ">=0.18.1,<=0.19.0": "deepspeed/0006-zero3-frozen-checkpointing-0.18.1-0.19.0.patch",
           ">=0.19.1,<=0.19.2": "deepspeed/0006-zero3-frozen-checkpointing-0.19.1-0.19.2.patch"},
    scenarios={"checkpoint_frozen_weight": checkpoint_frozen_weight,
               "accumulation_releases_frozen": accumulation_releases_frozen,
               "trainer_lora_non_reentrant": trainer_lora_non_reentrant},
    expected_on_stock={"checkpoint_frozen_weight": f"CheckpointError: {CHECKPOINT_ERROR}",
                       "accumulation_releases_frozen": f"CheckpointError: {CHECKPOINT_ERROR}",
                       "trainer_lora_non_reentrant": f"CheckpointError: {CHECKPOINT_ERROR}"},
    fixed_marker=("deepspeed.runtime.zero.partitioned_param_coordinator",
                  "PartitionedParameterCoordinator.release_backward_leftovers"),  # PR 8148's new method
    signatures=(r"CheckpointError: torch\.utils\.checkpoint: Recomputed values for the following tensors have "
                r"different metadata than during the forward pass",),
    note=("DeepSpeedZeRoOffload.post_sub_module_forward_function is wrapped: inside a backward pass (a checkpoint "
          "recompute) the submodule's frozen parameters stay gathered until its backward (or the end of the "
          "backward pass) releases them; outside one, upstream's call as it is"),
)

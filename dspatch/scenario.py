"""Helpers for reproducers: run real DeepSpeed in this process, on the CPU unless told otherwise.

The recipe: DS_ACCELERATOR=cpu, the gloo backend, LOCAL_SIZE set (older ZeRO-3
calls numactl without it), single-process rendezvous variables, and no JIT build of the shm comm op.
Variables already set (by torchrun, or a GPU user running --verify) are kept.
"""
import atexit
import contextlib
import importlib
import os

# the helpers across ranks live in dspatch.ranks; the ones reproducers import are importable from here too
from dspatch.ranks import (finish_rank, free_port, launch_ranks, leave_and_exit, leave_distributed,  # noqa: F401
                           rank_environment, settle)


def init_deepspeed():
    """Import deepspeed with distributed initialised; returns the deepspeed module."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = free_port()
    import deepspeed
    import torch.distributed

    if not torch.distributed.is_initialized():
        atexit.register(leave_distributed)
        if os.environ["DS_ACCELERATOR"] == "cpu":
            # the shm op is a 90-115 s JIT build on 2 cores and only speeds up CPU collectives
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo" if os.environ["DS_ACCELERATOR"] == "cpu" else None)
    return deepspeed


def on_accelerator(tensor):
    """`tensor` where DeepSpeed trains: the tensor itself on the CPU recipe (so CI's numbers are untouched), its copy
    on the GPU where the reproducers run with DS_ACCELERATOR=cuda. Inputs are built on the CPU from seeded CPU
    generators either way, so both see the same data."""
    if os.environ.get("DS_ACCELERATOR", "cpu") == "cpu":
        return tensor
    from deepspeed.accelerator import get_accelerator

    return tensor.to(get_accelerator().current_device_name())


def zero3_config(**zero):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 64, **zero},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    return config


@contextlib.contextmanager
def loads_past_weights_only_bug(unless_applied="deepspeed/checkpoint-weights-only"):
    """For reproducers that load checkpoints: deepspeed <= 0.15.4 (and old transformers' rng-state load) cannot
    torch.load their own checkpoints on torch >= 2.6 (another bug, dspatch's deepspeed/checkpoint-weights-only).
    Unless `unless_applied` is applied in this process, the loads inside use torch's own escape hatch
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (no effect where the caller passes weights_only itself), so that a
    reproducer shows its own bug and nothing else on every release."""
    if unless_applied and applied(unless_applied):
        yield
        return
    before = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = before


def reset_accelerate():
    """Forget accelerate's process-wide state (its singletons outlive an Accelerator), so that the next
    Accelerator or Trainer of this process is configured from scratch, as in a fresh job."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    # TrainingArguments(deepspeed=...) announces DeepSpeed to accelerate through the environment, which outlives it:
    # a later Trainer without DeepSpeed would be given one
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)


def applied(pid):
    """Whether dspatch applied patch `pid` in this process (from DSPATCH at start-up or dspatch.apply())."""
    from dspatch import _runtime

    return pid in _runtime.applied_ids()


def tiny_mlp():
    """Linear(8, 16), Tanh, Linear(16, 4), seeded: the layers of a pipeline or a plain model for the accumulation
    reproducers."""
    import torch

    torch.manual_seed(0)
    return [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)]


def regression_pairs(count):
    """`count` seeded (input, target) pairs for tiny_mlp: one micro-batch each."""
    import torch

    generator = torch.Generator().manual_seed(5)
    return [(torch.randn(1, 8, generator=generator), torch.randn(1, 4, generator=generator)) for _ in range(count)]


def tiny_llama(head="LlamaForCausalLM", seed=0, **config):
    """A tiny Llama built from a config (hidden 32, 2 layers, 4 heads, vocabulary 64 unless `config` says
    otherwise), its weights drawn after torch.manual_seed(seed); `seed=None` leaves the generator alone."""
    import torch
    import transformers

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    shape.update(config)
    if seed is not None:
        torch.manual_seed(seed)
    return getattr(transformers, head)(transformers.LlamaConfig(**shape))


def lm_rows(count, length, seed=3):
    """`count` causal-LM examples of `length` token ids drawn from 4-63 (labels = the ids), the same for a seed."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(4, 64, (count, length), generator=generator).tolist()]


def gathered_whole(named):
    """{name: a copy of the whole tensor} for (name, parameter) pairs of a model, gathered from the ZeRO-3
    partitions (a collective: every rank) one parameter at a time, so that it does not depend on the very bug
    deepspeed/zero3-gather-waits-all fixes: a gather of several at once returns early on gloo before 0.19.8.
    Parameters that are not ZeRO-3's are copied as they are."""
    import deepspeed

    whole = {}
    for name, param in named:
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            whole[name] = param.detach().clone()
    return whole


def train_with_deepspeed(trainer, error, reword):
    """trainer.train() of a Trainer that must run DeepSpeed (it is an error if it does not); `error` raised by
    the training is raised as reword(it); accelerate's state is reset after, whatever happens."""
    if not trainer.is_deepspeed_enabled:
        raise AssertionError("the Trainer did not use DeepSpeed")
    try:
        trainer.train()
    except error as e:
        raise reword(e) from e
    finally:
        reset_accelerate()


def sgd_trainer(model, rows, deepspeed, batch, accumulation, steps, lr=0.5, max_grad_norm=1e9, **arguments):
    """trainer.train() of a real Trainer with plain SGD at a constant rate and no effective clipping unless
    `max_grad_norm` says (an update is the gradient itself), logging grad_norm at every optimizer step: for the silent
    gradient bugs, proven by numbers.
    `deepspeed` is its DeepSpeed config, or None for the same run without DeepSpeed (on the CPU). Returns (the
    trainer, the grad_norm of each step); accelerate's state is reset before and after. `arguments`: more
    TrainingArguments (bf16=True, say)."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    reset_accelerate()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                                 max_steps=steps, optim="sgd", learning_rate=lr, lr_scheduler_type="constant",
                                 max_grad_norm=max_grad_norm, logging_steps=1, save_strategy="no", report_to=[],
                                 deepspeed=deepspeed, use_cpu=deepspeed is None, dataloader_num_workers=0, seed=0,
                                 data_seed=0, **arguments)
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        if trainer.is_deepspeed_enabled != (deepspeed is not None):
            raise AssertionError(f"the Trainer's DeepSpeed: {trainer.is_deepspeed_enabled}, wanted {deepspeed}")
        try:
            trainer.train()
        finally:
            reset_accelerate()
    norms = [float(entry["grad_norm"]) for entry in trainer.state.log_history if "grad_norm" in entry]
    if len(norms) != steps and max_grad_norm:  # with no clipping some releases compute (and log) no norm
        raise AssertionError(f"logged grad_norm {norms}, wanted {steps} steps")
    return trainer, norms


def lm_batches(count, length=8, seed=3):
    """lm_rows(count, length, seed) as micro-batches of one example each (tensors of shape [1, length])."""
    import torch

    return [{"input_ids": torch.tensor([row["input_ids"]]), "labels": torch.tensor([row["labels"]])}
            for row in lm_rows(count, length, seed)]


def lm_loss(model, batch):
    """The model's own loss on a micro-batch with labels."""
    return model(**batch).loss


def weights(model):
    """{name: a copy of the parameter} of a model, as it holds them (ZeRO-3 partitions: see gathered_whole)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def worst(got, want):
    """The largest relative difference (norm of the difference over the norm) between two sets of weights."""
    return max(float((got[name] - want[name]).norm() / want[name].norm()) for name in want)


def digest(named_weights):
    """A hash of a set of weights' bytes, in order: equal only where the weights are bit-identical (bf16 ones read
    as their 16 bits: numpy has no bf16)."""
    import hashlib

    import torch

    def raw(t):
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()

    return hashlib.sha256(b"".join(raw(t) for t in named_weights.values())).hexdigest()


def windows(micro_batches, accumulation, divisor=None):
    """`micro_batches` cut into accumulation windows, each micro-batch paired with the number its loss is divided by:
    `divisor(position in the window)`, `accumulation` where None is given; a divisor of None leaves that micro-batch
    out (as a bug that drops it does)."""
    steps = []
    for start in range(0, len(micro_batches), accumulation):
        window = []
        for position, batch in enumerate(micro_batches[start:start + accumulation]):
            by = divisor(position) if divisor else accumulation
            if by is not None:
                window.append((batch, by))
        steps.append(window)
    return steps


def sgd_windows(model, steps, lr, loss_of=lm_loss):
    """`model`'s weights after one plain-torch SGD step per window of `steps` (lists of (micro-batch, divisor), see
    windows()): each `loss_of(model, micro-batch) / divisor` back-propagated, then the step. The reference of the
    silent gradient bugs' reproducers: a bug's shape is the same steps with other windows or divisors."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for window in steps:
        for batch, by in window:
            (loss_of(model, batch) / by).backward()
        optimizer.step()
        optimizer.zero_grad()
    return weights(model)


def accelerate_sgd_loop(config, batches, accumulate=True, lr=0.5):
    """The weights of a tiny Llama after a custom accelerate loop under DeepSpeed (`config`, the DeepSpeed config;
    accelerate's accumulation is the config's `gradient_accumulation_steps`): one pass over `batches` (micro-batches of
    one example) through a prepared dataloader, each `accelerator.backward(out.loss); optimizer.step();
    optimizer.zero_grad()` under `accelerator.accumulate(model)` (or without it: `accumulate=False`), plain SGD at
    `lr`. accelerate's state is reset before and after."""
    import contextlib

    import torch

    init_deepspeed()
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    ga = config["gradient_accumulation_steps"]
    reset_accelerate()
    try:
        accelerator = Accelerator(gradient_accumulation_steps=ga, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
        model = tiny_llama()
        rows = [{key: value[0] for key, value in batch.items()} for batch in batches]
        loader = torch.utils.data.DataLoader(rows, batch_size=1)
        engine, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=lr), loader)
        if type(engine).__name__ != "DeepSpeedEngine" or engine.gradient_accumulation_steps() != ga:
            raise AssertionError(f"accelerate prepared {type(engine).__name__}, not DeepSpeed at accumulation {ga}")
        for batch in loader:
            with accelerator.accumulate(engine) if accumulate else contextlib.nullcontext():
                accelerator.backward(engine(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        reset_accelerate()
    return weights(model)


def word_tokenizer(vocab, folder=None, **special):
    """A fast tokenizer made in code (nothing from a hub): one token per whitespace-separated word of `vocab`
    (a list or {word: id}), `special` its special tokens (pad_token="<pad>", ...; padding_side too). Saved to
    `folder` when given, as trainers that reload their tokenizer need."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = vocab if isinstance(vocab, dict) else {word: i for i, word in enumerate(vocab)}
    unk = special.get("unk_token", special.get("pad_token"))
    backend = Tokenizer(models.WordLevel(ids, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    if folder is not None:
        tokenizer.save_pretrained(folder)
    return tokenizer


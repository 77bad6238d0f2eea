"""Reproducers (KTO's scenario is trl/precompute-ref-zero3-engine-kto's): real DPOTrainer and KTOTrainer with `precompute_ref_log_probs=True` and no `ref_model` (the reference
is the policy before training), a tiny Llama, a tokenizer made in code, four examples, two steps, fp32, 1 CPU rank.
Each runs the same recipe without DeepSpeed first (the reference numbers), then at ZeRO-3 with the whole reference
pass in one batch, and compares: the reference log-probs stored in the dataset, the logged losses and the weights
after training.

Tolerances: the reference log-probs are compared exactly (the same weights, gathered, in the same forward). After two
AdamW steps (updates of about 1e-2 each) ZeRO-3's flat fp32 partitions and its reduce give weights within 1e-5 of
torch's (seen: up to 1.7e-6, KTO); the losses are logged rounded to 4 decimals: compared to 1e-4.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

WORDS = "the a cat dog sat ran on mat log big small red blue one two three four five six seven".split()
PROMPTS = ["the cat sat", "a dog ran", "one two three", "big red log"]
GOOD = [" on the mat", " on a log", " four five", " is small"]
BAD = [" blue", " seven six", " red red", " the the"]
DEEPSPEED = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "steps_per_print": 10**6,
             "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}


def _tokenizer():
    from dspatch.scenario import word_tokenizer

    return word_tokenizer(["<pad>", "<s>", "</s>", "<unk>"] + WORDS, pad_token="<pad>", bos_token="<s>",
                          eos_token="</s>", unk_token="<unk>")


def run(kind, zero=None, reference_batches=1, **extra):
    """Train `kind` ("dpo" or "kto") for two steps with a precomputed reference; `zero`: the DeepSpeed
    zero_optimization block (None: no DeepSpeed). Returns {refs, losses, weights}."""
    import tempfile

    from dspatch.scenario import gathered_whole, init_deepspeed, reset_accelerate, tiny_llama

    init_deepspeed()
    import trl
    from datasets import Dataset

    reset_accelerate()
    rows = {"prompt": PROMPTS}
    if kind == "dpo":
        rows.update(chosen=GOOD, rejected=BAD)
        config, trainer_class = trl.DPOConfig, trl.DPOTrainer
    else:
        rows.update(completion=GOOD, label=[True, False, True, False])
        config, trainer_class = trl.KTOConfig, trl.KTOTrainer
    model = tiny_llama(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with tempfile.TemporaryDirectory() as out:
        args = config(output_dir=out, per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2, logging_steps=1,
                      save_strategy="no", report_to=[], bf16=False, seed=0, dataloader_num_workers=0,
                      precompute_ref_log_probs=True, precompute_ref_batch_size=len(PROMPTS) // reference_batches,
                      deepspeed=None if zero is None else {**DEEPSPEED, "zero_optimization": zero}, **extra)
        try:
            trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_dict(rows),
                                    processing_class=_tokenizer())
            refs = {c: list(trainer.train_dataset[c]) for c in trainer.train_dataset.column_names if c.startswith("ref_")}
            trainer.train()
        finally:
            reset_accelerate()
        weights = gathered_whole(trainer.model.named_parameters())
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"refs": refs, "losses": losses, "weights": weights}


def _precomputed_at_zero3(kind, **extra):
    import torch

    want = run(kind, **extra)
    try:
        got = run(kind, zero=ZERO3, **extra)
    except IndexError as e:
        if "pop from an empty deque" not in str(e):
            raise
        raise BugSeen(f"{kind.upper()} with a reference precomputed in one batch at ZeRO-3: the first training "
                      f"forward: IndexError: {e}") from e
    if got["refs"] != want["refs"]:
        raise AssertionError(f"reference log-probs under ZeRO-3 {got['refs']} differ from {want['refs']}")
    if len(got["losses"]) != 2 or any(abs(a - b) > 1e-4 for a, b in zip(got["losses"], want["losses"])):
        raise AssertionError(f"losses under ZeRO-3 {got['losses']} differ from {want['losses']}")
    for name, tensor in want["weights"].items():
        if not torch.allclose(got["weights"][name], tensor, rtol=0, atol=1e-5):
            raise AssertionError(f"{name} after training under ZeRO-3 differs from the run without DeepSpeed by "
                                 f"{(got['weights'][name] - tensor).abs().max().item()}")


def dpo_precomputed_zero3():
    """DPO, the reference precomputed in one batch at ZeRO-3: trains, with the reference log-probs, losses and weights
    of the same training without DeepSpeed."""
    _precomputed_at_zero3("dpo")


def kto_precomputed_zero3():
    """KTO (apo_zero_unpaired: one reference forward per batch), the reference precomputed in one batch at ZeRO-3:
    trains, with the reference log-probs, losses and weights of the same training without DeepSpeed."""
    _precomputed_at_zero3("kto", loss_type="apo_zero_unpaired")


def dpo_precomputed_zero2():
    """DPO, the reference precomputed at ZeRO-2 (a stage-0 inference engine, then the ZeRO-2 training engine):
    trains, with the numbers of the same training without DeepSpeed (this passes on stock too)."""
    import torch

    want = run("dpo")
    got = run("dpo", zero={"stage": 2})
    if got["refs"] != want["refs"] or got["losses"] != want["losses"] or any(
            not torch.equal(got["weights"][name], tensor) for name, tensor in want["weights"].items()):
        raise AssertionError("DPO with a precomputed reference at ZeRO-2 differs from the run without DeepSpeed")


PROOF = Proof(
    scenarios={"dpo_precomputed_zero3": dpo_precomputed_zero3, "dpo_precomputed_zero2": dpo_precomputed_zero2},
    expected_on_stock={
      "dpo_precomputed_zero3": "DPO with a reference precomputed in one batch at ZeRO-3: the first training forward: "
                               "IndexError: pop from an empty deque",
  },
    # The releases of trl that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("1.8.0", "1.16.0"),
)

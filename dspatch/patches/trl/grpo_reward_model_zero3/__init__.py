"""A model as a GRPO reward function works under ZeRO-3 (trl 0.14.0-0.16.1).

`GRPOTrainer.__init__` prepares each `PreTrainedModel` in `reward_funcs` with `accelerator.prepare_model(...,
evaluation_mode=True)`, which under DeepSpeed builds no engine. A reward model created while the Trainer's ZeRO-3 config
is live (as `from_pretrained` and `from_config` create it: under `deepspeed.zero.Init`) stays partitioned, with no hooks
to gather its weights, and the first reward computation fails: `Padding_idx must be within num_embeddings` or `'weight'
must be 2-D` (trl issue 3202). trl 0.17.0 fixed it (PR 3326) by preparing such a reward model with `prepare_deepspeed`
under DeepSpeed, as the trainer already does for its reference model.

The fix does the same: `GRPOTrainer.__init__` is rebuilt from the installed source with that one statement put under `if
self.is_deepspeed_enabled: prepare_deepspeed(reward_func, self.accelerator) else: <as it was>`. Decided: unlike 0.17.0
it keeps the model itself, not the engine, in `reward_funcs` (the engine registers ZeRO-3's hooks on it, which gather
its weights whenever it is called): 0.14-0.16 read the reward model's `.config` where 0.17 stores the engine and reads
precomputed names, so keeping the model changes nothing else of theirs.

Proven on the bridge stack (trl 0.15.2): 2 GRPO steps at ZeRO-3 train, and the rewards equal the reward model's own
output on the same completions without DeepSpeed.
"""
from dspatch.spec import Patch, Signature

GRPO = "trl.trainer.grpo_trainer"
INIT = "GRPOTrainer.__init__"
FINGERPRINTS = {(GRPO, INIT): {"dbb940412e4d2bc5": "0.14.0", "7c019ffd2bf33408": "0.15.0-0.15.2",
                                "22efc8433147ec61": "0.16.0-0.16.1"}}
GRPO_FRAME = r"trl[/\\]trainer[/\\]grpo_trainer\.py"  # trl's own (copies in other projects are not patched)
REWARD_CALL = r"reward_func\(|rewards_per_func|reward_model"  # the failing call is the reward model's
PARTITIONED = ("Padding_idx must be within num_embeddings", "'weight' must be 2-D")


def reward_models_through_deepspeed(definition):
    """Transform: `self.reward_funcs[i] = self.accelerator.prepare_model(reward_func, evaluation_mode=True)` ->
    the same under `else:` of `if self.is_deepspeed_enabled: prepare_deepspeed(reward_func, self.accelerator)`."""
    from dspatch.rewrite import find_statement, statement

    block, index = find_statement(
        definition, "self.reward_funcs[i] = self.accelerator.prepare_model(reward_func, evaluation_mode=True)")
    original = block[index]
    branch = statement("if self.is_deepspeed_enabled:\n"
                       "    prepare_deepspeed(reward_func, self.accelerator)\n"
                       "else:\n    pass", original)
    branch.orelse = [original]
    block[index] = branch


def apply(txn):
    txn.recode(txn.target(INIT), reward_models_through_deepspeed)


PATCH = Patch(
    id="trl/grpo-reward-model-zero3",
    summary=("GRPOTrainer under ZeRO-3 prepares a model given as a reward function with DeepSpeed, so its partitioned "
             "weights are gathered (no `Padding_idx must be within num_embeddings` / `'weight' must be 2-D`)"),
    cause="GRPO runs a model given as a reward function on ZeRO-3 partitioned weights without gathering them",
    symptom="`Padding_idx must be within num_embeddings` or `'weight' must be 2-D` at the first reward",
    distribution="trl",
    affected=">=0.14.0,<0.17.0",
    fixed_in="0.17.0",
    supported=">=0.14.0",
    targets=FINGERPRINTS,
    apply=apply,
    links=("https://github.com/huggingface/trl/issues/3202", "https://github.com/huggingface/trl/pull/3326"),
    diffs=("trl/0003-grpo-reward-model-zero3-0.14.0-0.16.1.patch",),
    # messages any partitioned or mismatched embedding gives: GRPO's own frames decide
    signatures=(Signature(r"Padding_idx must be within num_embeddings", error="RuntimeError|AssertionError",
                          needs=(GRPO_FRAME, REWARD_CALL)),
                Signature(r"'weight' must be 2-D", error="RuntimeError", needs=(GRPO_FRAME, REWARD_CALL))),
    note=("GRPOTrainer.__init__ keeps its object, name and line numbers but runs code rebuilt from the installed file "
          "that prepares model reward functions with trl's prepare_deepspeed under DeepSpeed"),
)

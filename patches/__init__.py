"""The patch registry: one module per patch, grouped by the upstream project it fixes.

Adding a patch = adding its module here. Each module defines `PATCH` (a dspatch.spec.Patch) and imports
nothing heavy at module level.
"""

MODULES = (
    "deepspeed.zero3_module_id",
    "deepspeed.engine_module_hint",
    "deepspeed.initialize_once",
    "deepspeed.checkpoint_weights_only",
    "deepspeed.frozen_param_names",
    "accelerate.deepspeed_scheduler_param_groups",
    "transformers.trainer_scheduler_after_deepspeed",
    "trl.zero3_generation_hooks",
    "accelerate.deepspeed_no_sync",
    "transformers.peft_zero3_save",
    "deepspeed.zero3_frozen_checkpointing",
    "trl.ppo_deepspeed_save",
    "deepspeed.zero3_trace_invalidation",
    "deepspeed.zero3_modules_to_save_grads",
    "deepspeed.engine_releases_model",
    "transformers.deepspeed_grad_accum_scale",
    "transformers.deepspeed_prefetch_bucket_int",
    "accelerate.zero3_save_model_all_ranks",
    "trl.grpo_reward_model_zero3",
    "deepspeed.zero_to_fp32_tied_weights",
    "deepspeed.zero3_gather_waits_all",
    "trl.precompute_ref_zero3_engine",
    "trl.precompute_ref_zero3_engine_kto",
    "transformers.trainer_stale_deepspeed_engine",
    "transformers.resume_rng_weights_only",
    "deepspeed.zero_init_inherited_init",
    "deepspeed.zero2_offload_grad_accum",
    "deepspeed.output_hooks_gas_per_tensor",
    "deepspeed.backward_scale_wrt_gas",
    "deepspeed.zero2_grad_accum_last_microbatch",
    "accelerate.deepspeed_ga_boundary",
    "deepspeed.grad_accum_scale_no_allreduce",
    "deepspeed.zero0_bf16_grads",
    "deepspeed.pipe_grad_accum_scale",
    "deepspeed.lr_schedules_multigroup",
    "deepspeed.zero3_allreduce_fetch_padding",
)

"""Bad configurations and overrides: each is one line on stderr, exit 2, nothing written."""

from __future__ import annotations

import pytest

from tests.bad_input.conftest import assert_one_line_error, run_against
from tests.trainer.cli_helpers import snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

_COMPILED = ["trainer.mode=compiled", "trainer.device=tpu"]

# name: (overrides, text the error line must contain)
SCHEMA = {
    "unknown_key": (["trainer.maxsteps=3"], "section 'trainer' has keys"),
    "unknown_top_level": (["trainr.seed=1"], "the top level has keys"),
    "unknown_nested_key": (["recipe.lora.rnk=4"], "alpha, dropout, rank, targets"),
    "unknown_recipe": (["recipe=llama_pretrian"], "valid options: eval, generate"),
    "unknown_model": (["model=llama9"], "valid options: debug_tiny"),
    "unknown_scheduler": (["scheduler=linear"], "valid options: constant"),
    "unknown_optim_option": (["optim=sgd"], "valid options: adamw"),
    "unknown_data_option": (["data=parquetx"], "valid options: bundled"),
    "unknown_parallel_option": (["parallel=ddp"], "valid options: fsdp"),
    "wrong_type": (["trainer.max_steps=ten"], "could not be converted to Integer"),
    "wrong_type_float": (["optim.lr=fast"], "optim.lr"),
    "wrong_type_bool": (["logging.tensorboard=maybe"], "logging.tensorboard"),
    "wrong_type_list": (["recipe.lora.targets=wq"], "recipe.lora.targets"),
    "wrong_type_prefetch": (["data.prefetch=two"], "data.prefetch"),
    "section_as_value": (["trainer=3"], "trainer"),
    "bad_enum": (["trainer.mode=fast"], "expected one of [eager, fused, compiled]"),
    "bad_precision": (["trainer.precision=fp8"], "expected one of [fp32, bf16]"),
    "bad_param_dtype": (["trainer.param_dtype=fp16"], "expected one of [fp32, bf16]"),
    "bad_matmul_precision": (["trainer.matmul_precision=low"],
                             "expected one of [highest, high, medium]"),
    "bad_on_nan": (["trainer.on_nan=ignore"], "expected one of [stop, skip]"),
    "bad_remat": (["trainer.remat=some"],
                  "expected one of [none, full, save_dots, save_qkv_proj, offload]"),
    "bad_schedule_name": (["scheduler.name=linear"], "scheduler.name"),
    "bad_data_source": (["data.source=random"], "expected one of [files, synthetic_tokens]"),
    "added_unknown_key": (["+trainer.foo=1"], "trainer.foo is not a setting"),
    "added_unknown_section": (["+bogus_section.x=2"], "bogus_section is not a setting"),
    "force_added_unknown_key": (["++trainer.foo=1"], "trainer.foo is not a setting"),
    "deleted_required_key": (["~trainer.max_steps"], "trainer.max_steps"),
}

VALUES = {
    "zero_steps": (["trainer.max_steps=0"], "trainer.max_steps must be >= 1"),
    "remat_and_old_switch": (["trainer.remat=save_dots", "trainer.activation_checkpointing=true"],
                             "trainer.activation_checkpointing=true means trainer.remat=full, "
                             "but trainer.remat=save_dots; set only trainer.remat"),
    "offload_eager": (["trainer.mode=eager", "trainer.remat=offload"],
                      "trainer.remat=offload moves layer inputs to host memory in the compiled "
                      "step; trainer.mode=eager does not: use trainer.remat=full"),
    "offload_unscanned": ([*_COMPILED, "trainer.remat=offload"],
                          "trainer.remat=offload moves the inputs of scanned layers to host "
                          "memory: set trainer.scan_layers=true"),
    "negative_steps": (["trainer.max_steps=-5"], "trainer.max_steps must be >= 1"),
    "negative_lr": (["optim.lr=-1"], "optim.lr must be > 0"),
    "zero_lr": (["optim.lr=0"], "optim.lr must be > 0"),
    "infinite_lr": (["optim.lr=inf"], "optim.lr"),
    "nan_lr": (["optim.lr=nan"], "optim.lr"),
    "bad_beta": (["optim.beta2=1.5"], "optim.beta1 and optim.beta2"),
    "negative_beta": (["optim.beta1=-0.1"], "optim.beta1 and optim.beta2"),
    "zero_eps": (["optim.eps=0"], "optim.eps"),
    "negative_weight_decay": (["optim.weight_decay=-0.1"], "optim.weight_decay"),
    "unknown_optimizer_name": (["optim.name=adamax9"], "optim.name"),
    "state_dtype_without_moments": (["optim.name=sgd", "optim.state_dtype=bf16"],
                                    "optim.name=sgd has none it stores"),
    "unknown_state_dtype": (["optim.state_dtype=fp16"], "optim.state_dtype"),
    "negative_warmup": (["scheduler.warmup_steps=-1"], "scheduler.warmup_steps must be >= 0"),
    "min_lr_ratio_above_one": (["scheduler.min_lr_ratio=2"], "scheduler.min_lr_ratio"),
    "negative_min_lr_ratio": (["scheduler.min_lr_ratio=-0.5"], "scheduler.min_lr_ratio"),
    "decay_fraction_above_one": (["scheduler=wsd", "scheduler.decay_fraction=1.5"],
                                 "scheduler.decay_fraction"),
    "grad_accum_zero": (["trainer.grad_accum_steps=0"], "trainer.grad_accum_steps"),
    "micro_batch_size_zero": (["trainer.micro_batch_size=0"], "trainer.micro_batch_size"),
    "micro_batch_size_not_dividing": (["trainer.micro_batch_size=3", "data.batch_size=8"],
                                      "choose one of 1, 2, 4, 8, or null"),
    "max_grad_norm_negative": (["trainer.max_grad_norm=-1"], "trainer.max_grad_norm"),
    "val_every_negative": (["trainer.val_every_n_steps=-1"], "trainer.val_every_n_steps"),
    "val_batches_zero": (["trainer.val_batches=0"], "trainer.val_batches"),
    "cpu_threads_zero": (["trainer.cpu_threads=0"], "trainer.cpu_threads must be >= 1 or null"),
    "loss_chunk_tokens_zero": (["trainer.loss_chunk_tokens=0"],
                               "trainer.loss_chunk_tokens must be >= 1 or null"),
    "bad_device": (["trainer.device=gpu"], "valid devices: cpu, tpu"),
    "indexed_device": (["trainer.device=tpu:9"], "trainer.device"),
    "compiled_on_cpu": (["trainer.mode=compiled"], "trainer.mode=compiled needs trainer.device=tpu"),
    "fused_on_cpu": (["trainer.mode=fused"], "trainer.mode=fused needs trainer.device=tpu"),
    "batch_size_zero": (["data.batch_size=0"], "data.batch_size"),
    "seq_len_zero": (["data.seq_len=0"], "data.seq_len"),
    "seq_len_too_long": (["data.seq_len=100000"], "set model.max_seq_len=100000 to give"),
    "n_layers_zero": (["model.n_layers=0"], "model.n_layers must be >= 1 or null"),
    "max_seq_len_zero": (["model.max_seq_len=0"], "model.max_seq_len must be >= 1 or null"),
    "n_layers_with_a_checkpoint": (["model.n_layers=1", "model.checkpoint=${asset:base_model}"],
                                   "model.checkpoint's weights fix its layers"),
    "shuffle_buffer_negative": (["data.shuffle_buffer=-1"], "data.shuffle_buffer"),
    "prefetch_negative": (["data.prefetch=-1"], "data.prefetch must be >= 0 (0: build each"),
    "bad_format": (["data.format=csv"], "valid formats: auto, text, instruction, chat"),
    "missing_data_file": (["data.path=/nonexistent/train.jsonl"], "does not exist"),
    "missing_val_file": (["data=jsonl", "data.path=${asset:corpus/tasks_train.jsonl}",
                          "data.val_path=/nonexistent/v.jsonl"],
                         "data.val_path='/nonexistent/v.jsonl' does not exist"),
    "data_path_is_a_directory": (["data=jsonl", "data.path=/"], "data.path: /: a directory that is not"),
    "jsonl_without_path": (["data=jsonl"], "data.path"),
    "synthetic_tokens_with_path": (["data=synthetic_tokens",
                                    "data.path=${asset:corpus/tasks_train.jsonl}"],
                                   "data.source=synthetic_tokens trains on random token ids"),
    "synthetic_tokens_with_val_path": (["data=synthetic_tokens",
                                        "data.val_path=${asset:corpus/tasks_heldout.jsonl}"],
                                       "drop data.val_path"),
    "synthetic_tokens_with_packing": (["data=synthetic_tokens", "data.packing=true"],
                                      "random token ids with no samples; drop data.packing"),
    "eval_on_synthetic_tokens": (["recipe=eval", "data=synthetic_tokens"],
                                 "data=synthetic_tokens generates random token ids"),
    # The existing run trained on files: its data position means nothing for random tokens.
    "resume_files_run_on_synthetic_tokens": (["data=synthetic_tokens"], "not of random tokens"),
    "missing_tokenizer": (["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer"),
    "keep_last_zero": (["checkpoint.keep_last=0"], "checkpoint.keep_last must be >= 1"),
    "every_n_zero": (["checkpoint.every_n_steps=0"], "checkpoint.every_n_steps must be >= 1"),
    "load_step_not_saved": (["checkpoint.load_step=7"], "checkpoint.load_step=7"),
    "load_step_negative": (["checkpoint.load_step=-1"], "checkpoint.load_step"),
    "resume_refused": (["checkpoint.resume=false"], "checkpoint.resume=false"),
    "logging_every_zero": (["logging.every_n_steps=0"], "logging.every_n_steps"),
    "bad_profile_steps": (["logging.profile_steps=[3,2]"], "logging.profile_steps must be"),
    "profile_steps_one_value": (["logging.profile_steps=[3]"], "logging.profile_steps must be"),
    "bad_parallel": (["parallel.fsdp=0"], "parallel.fsdp must be -1 (infer) or >= 1"),
    "bad_parallel_tensor": (["parallel.tensor=-2"], "parallel.tensor"),
    "bad_parallel_data": (["parallel.data=0"], "parallel.data"),
    "two_inferred_axes": (["parallel.fsdp=-1", "parallel.tensor=-1"],
                          "at most one of parallel.fsdp and parallel.tensor"),
    "eager_parallel_needs_processes": (["parallel.fsdp=2"], "launch torchrun --nproc-per-node 2"),
    "eager_tensor_needs_processes": (["parallel.tensor=2"], "--nproc-per-node 2"),
    "missing_model_checkpoint": (["model.checkpoint=/nonexistent/ckpt"], "is not a directory"),
    "pretrain_with_checkpoint": (["recipe=llama_pretrain", "model.checkpoint=."],
                                 "starts from random weights"),
    "bad_lora_target": (["recipe=llama_lora", "recipe.lora.targets=[wq,q_proj]"],
                        "match no nn.Linear"),
    "empty_lora_targets": (["recipe=llama_lora", "recipe.lora.targets=[]"], "recipe.lora.targets"),
    "bad_lora_rank": (["recipe=llama_lora", "recipe.lora.rank=0"], "recipe.lora.rank must be >= 1"),
    "bad_lora_alpha": (["recipe=llama_lora", "recipe.lora.alpha=0"], "recipe.lora.alpha"),
    "bad_lora_dropout": (["recipe=llama_lora", "recipe.lora.dropout=1.5"], "recipe.lora.dropout"),
    "resume_with_other_seq_len": (["data.seq_len=16"],
                                  "holds a checkpoint of a different configuration"),
    "temperature": (["recipe=generate", "recipe.generate.temperature=-1"],
                    "temperature must be >= 0"),
    "top_p_above_one": (["recipe=generate", "recipe.generate.top_p=1.5"], "recipe.generate.top_p"),
    "max_new_tokens_zero": (["recipe=generate", "recipe.generate.max_new_tokens=0"],
                            "recipe.generate.max_new_tokens"),
    "no_prompts": (["recipe=generate", "recipe.generate.prompts=[]"], "recipe.generate.prompts"),
    "eval_batches_zero": (["recipe=eval", "recipe.eval.batches=0"], "recipe.eval needs batches >= 1"),
    # The compiled step on the session's 8 virtual devices: every mesh mismatch is bad input.
    "mesh_larger_than_devices": ([*_COMPILED, "parallel.data=1", "parallel.fsdp=16"],
                                 "= 16, but there are 8 devices"),
    "mesh_not_dividing_devices": ([*_COMPILED, "parallel.tensor=3"],
                                  "multiply to 3, which does not divide the 8 devices"),
    "tensor_not_dividing_kv_heads": ([*_COMPILED, "parallel.data=1", "parallel.fsdp=2",
                                      "parallel.tensor=4"], "does not divide n_kv_heads=2"),
    "expert_parallel_without_experts": ([*_COMPILED, "parallel.expert=2"],
                                        "parallel.expert=2 splits a mixture of experts"),
    "expert_not_dividing_devices": ([*_COMPILED, "model=mixtral_tiny", "parallel.expert=3"],
                                    "multiply to 3, which does not divide the 8 devices"),
    "expert_parallel_in_eager_mode": (["model=mixtral_tiny", "parallel.expert=2"],
                                      "parallel.expert=2 (expert parallelism) needs "
                                      "trainer.mode=compiled"),
    "bad_parallel_expert": (["parallel.expert=0"], "parallel.expert must be -1 (infer) or >= 1"),
    "bad_moe_impl": (["model.moe_impl=sparse"], "model.moe_impl must be one of dense, grouped"),
    "moe_impl_without_experts": ([*_COMPILED, "model.moe_impl=grouped"],
                                 "has no experts: drop model.moe_impl"),
    "grouped_experts_recomputed": ([*_COMPILED, "model=mixtral_tiny", "model.moe_impl=grouped",
                                    "trainer.remat=full"], "no PyTorch backward"),
    "batch_not_splitting_over_mesh": ([*_COMPILED, "data.batch_size=4"],
                                      "data.batch_size=4 (the global batch) does not split over "
                                      "parallel.data * fsdp = 8 * 1 = 8 ways"),
    "context_zero": (["parallel.context=0"], "parallel.context must be >= 1"),
    "context_in_eager_mode": (["parallel.context=2"],
                              "parallel.context=2 splits sequences in the compiled SPMD step; "
                              "trainer.mode=eager has none"),
    "context_with_packing": ([*_COMPILED, "parallel.context=2", "data.packing=true"],
                             "does not support data.packing=true"),
    "context_not_dividing_seq_len": ([*_COMPILED, "parallel.context=4", "data.seq_len=36"],
                                     "data.seq_len=36 does not split into 2 x "
                                     "parallel.context = 8 equal chunks"),
    "context_not_dividing_devices": ([*_COMPILED, "parallel.context=16"],
                                     "(context=16 among them) multiply to 16, which does not "
                                     "divide the 8 devices"),
}

SYNTAX = {
    "unbalanced_bracket": (["trainer.max_steps=["], "trainer.max_steps"),
    "no_value": (["trainer.max_steps"], "trainer.max_steps"),
    "no_key": (["=3"], "override '=3' names no key"),
    "unbalanced_quote": (["recipe.generate.prompts=['a"], "recipe.generate.prompts"),
    "bad_interpolation": (["run.dir=${nothere}"], "nothere"),
    "missing_recipe_script": (["recipe=./no_such_recipe.py"], "no such recipe script"),
    "group_override_without_option": (["model="], "model"),
}
CASES = {**SCHEMA, **VALUES, **SYNTAX}


# The mesh cases name the session's 8 virtual devices.
EIGHT_DEVICES = {"mesh_larger_than_devices", "mesh_not_dividing_devices",
                 "tensor_not_dividing_kv_heads", "batch_not_splitting_over_mesh",
                 "context_not_dividing_devices"}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.devices(8) if name in EIGHT_DEVICES else ())
    for name in sorted(CASES)])
def test_bad_config_is_one_line_and_writes_nothing(name, existing_run):
    overrides, expected = CASES[name]
    before = snapshot(existing_run)
    code, out, err = run_against(existing_run, *overrides)
    assert_one_line_error(code, out, err, expected)
    assert snapshot(existing_run) == before

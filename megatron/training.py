"""Megatron's training loop, driven by three providers (datasets, model, forward step), so pretrain_gpt.py
stays short. The ZeRO (--deepspeed) branches sit exactly where the DeepSpeed-Megatron tutorial puts them:
get_optimizer, setup_model_and_optimizer, backward_step, train_step and the log line.

The parts that stand on their own are in megatron/trainer/ (each re-exported here): builders.py (the weight-decay
groups, the lr schedule), log_line.py (training_log, flops_per_token), data_iterators.py."""
import dataclasses
import datetime
import math

import torch

import mpu
from megatron import zero
from megatron.checkpoint import finalize_async_save, load_checkpoint, save_checkpoint
from megatron.fp16 import FP16_Optimizer, LossScaler, LossScalerConfig
from megatron.global_vars import get_args, get_tensorboard_writer, get_timers, get_tokenizer
from megatron.guards import breadcrumbs, memory, operations
from megatron.guards.exit_controller import ExitController
from megatron.initialize import initialize_megatron, layout_line
from megatron.model import DistributedDataParallel as LocalDDP
from megatron.model.moe_args import moe_log_fields, StarvingExpertWatch
from megatron.pipeline import p2p_communication, schedules
from megatron.train_state import CheckpointOptions, TrainState
from megatron.trainer.builders import (NORMALIZATIONS, get_learning_rate_scheduler,  # noqa: F401
                                       param_groups_for_weight_decay, resumed_lr_line)
from megatron.trainer.data_iterators import build_train_valid_test_data_iterators
from megatron.trainer.downstream_eval import DownstreamEval
from megatron.trainer.fault_tolerance import NoReplicaGroups, ReplicaTraining
from megatron.trainer.log_line import flops_per_token, IntervalLog, log_due, training_log  # noqa: F401
from megatron.utils import print_rank_0, unwrap_model


def pretrain(train_valid_test_dataset_provider, model_provider, forward_step_func, extra_args_provider=None,
             args_list=None, after_training=None):
    """Initialize, build model/optimizer/data, train, evaluate. Returns the per-iteration history
    ({'iteration': [...], 'lm loss': [...], 'loss scale': [...], 'skipped': [...], 'valid': [...]}).
    `after_training(model)`, if given, runs on every rank once the loop ends, before the last save and evaluation
    (finetune_gpt.py's samples after the last iteration)."""
    args = initialize_megatron(extra_args_provider, args_list)
    print_rank_0(layout_line(args))
    downstream = DownstreamEval.from_args(args, get_tokenizer(), get_tensorboard_writer())   # --eval-tasks
    model, optimizer, lr_scheduler, train_state = setup_model_and_optimizer(model_provider)
    train_iterator, valid_iterator, test_iterator = build_train_valid_test_data_iterators(
        train_valid_test_dataset_provider, train_state)
    if train_state.iteration >= args.train_iters:
        print_rank_0(f"nothing to train: the checkpoint is at iteration {train_state.iteration} and --train-iters "
                     f"is {args.train_iters}; raise --train-iters (TRAIN_ITERS in the scripts) to train further")
    if args.log_jsonl and args.rank == 0:
        operations.write_jsonl_record(args.log_jsonl, operations.header_record(args, train_state.iteration))
    replicas = ReplicaTraining.from_args(args, model, train_state)    # --ft-replica-groups (R = 1: nothing)
    history = train(forward_step_func, model, optimizer, lr_scheduler, train_iterator, valid_iterator, train_state,
                    downstream, replicas)
    replicas.shutdown()
    if after_training is not None:
        after_training(model)
    if args.save and history["last_saved_iteration"] != train_state.iteration:
        save_checkpoint(train_state, model, optimizer, lr_scheduler, CheckpointOptions.from_args(args))
        history["last_saved_iteration"] = train_state.iteration
    finalize_async_save()   # --async-save: wait for the last save's files, publish it
    if "exit_reason" not in history:
        downstream.at_end(model, train_state.iteration, history)
    if args.do_valid and "exit_reason" not in history:  # an early exit (preemption) leaves at once
        history["final_valid"] = evaluate_and_print_results("the end of training", forward_step_func,
                                                            valid_iterator, model, train_state)
    if args.do_test and "exit_reason" not in history:  # the test split, once (its samples are not counted)
        history["final_test"] = evaluate_and_print_results("the end of training for test data", forward_step_func,
                                                           test_iterator, model,
                                                           TrainState(iteration=train_state.iteration), split="test")
    return history


def get_model(model_provider):
    """Build the model on this rank's device, cast to the training dtype, wrap for data parallelism."""
    args = get_args()
    print_rank_0(f" > {getattr(args, 'torch_compile_choice', 'fused compute path: off')}")
    model = model_provider()
    if args.rank == 0 or mpu.get_data_parallel_rank() == 0 and mpu.get_model_parallel_rank() > 0:
        count = sum(mpu.full_numel(p) for p in model.parameters())   # whole sizes, also under zero.Init
        trainable = sum(mpu.full_numel(p) for p in model.parameters() if p.requires_grad)
        frozen = f" ({trainable} trainable, the rest frozen)" if trainable < count else ""
        print(f" > number of parameters on model-parallel rank {mpu.get_model_parallel_rank()}: {count}{frozen}",
              flush=True)
    model.to(device=mpu.get_device(), dtype=getattr(torch, args.params_dtype))
    if args.deepspeed:
        return model  # the ZeRO engine does the data-parallel reduction
    if args.DDP_impl == "torch":
        device_ids = [mpu.get_device()] if mpu.get_device().type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                                         process_group=mpu.get_data_parallel_group(
                                                             with_context_parallel=True))
    return LocalDDP(model)


def get_optimizer(model, lr=None):
    """AdamW over the trainable parameters at --lr (or `lr`: train_rlhf.py's critic)."""
    args = get_args()
    lr = args.lr if lr is None else lr
    groups = param_groups_for_weight_decay(unwrap_model(model))
    # the step runs on fp32 (fp32 params, or the fp32 masters of FP16_Optimizer and the engine)
    kernel = zero.adam_kernel_options(next(unwrap_model(model).parameters()).device) if args.fused_adam else {}
    adam = {"lr": lr, "weight_decay": args.weight_decay, "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_eps}
    if args.optimizer == "muon":
        muon = {"lr": args.muon_lr * lr / args.lr, "momentum": args.muon_momentum, "weight_decay": args.weight_decay,
                "nesterov": True, "ns_steps": 5, "ns_method": args.muon_ns_method}
        optimizer = zero.Muon(zero.split_param_groups(unwrap_model(model), groups, muon, adam), adam_kernel=kernel)
    else:
        optimizer = torch.optim.AdamW(groups, **adam, **kernel)
    if args.deepspeed:
        return optimizer  # the engine adds master weights and loss scaling itself
    if args.fp16:
        return FP16_Optimizer(optimizer, LossScaler(_loss_scaler_config(args)))
    if args.bf16:
        return FP16_Optimizer(optimizer, scaler=None)
    return optimizer


def _loss_scaler_config(args):
    return LossScalerConfig(loss_scale=args.loss_scale or 0.0,
                            initial_scale_power=math.log2(args.initial_loss_scale),
                            loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
                            min_loss_scale=args.min_scale)


def setup_model_and_optimizer(model_provider, options=None, lr=None, accumulation=1):
    """(model, optimizer, lr_scheduler, TrainState): built, wrapped, and loaded from --load when given. A second
    model of the same run (train_rlhf.py's critic) passes its own CheckpointOptions (its load) and peak lr.
    `accumulation` k: the model's steps take k x the run's micro-batches (train_step's num_micro_batches; the
    engine's gradient_accumulation_steps and train_batch_size are k x the config's: train_rlhf.py's actor with PTX,
    DeepSpeed-Chat's doubled gradient_accumulation_steps_actor)."""
    args = get_args()
    model = get_model(model_provider)
    optimizer = get_optimizer(model, lr)
    lr_scheduler = get_learning_rate_scheduler(optimizer, lr)
    config = args.zero_config
    if config is not None and accumulation != 1:
        config = dataclasses.replace(config, train_batch_size=config.train_batch_size * accumulation,
                                     gradient_accumulation_steps=config.gradient_accumulation_steps * accumulation)
    if args.deepspeed:
        if config.scheduler is not None:      # the JSON's scheduler block is the schedule: the engine builds it
            lr_scheduler = None
        model, optimizer, _, lr_scheduler = zero.initialize(model=model, optimizer=optimizer, args=args,
                                                            lr_scheduler=lr_scheduler, mpu=mpu,
                                                            dist_init_required=False, config=config)
        optimizer.skip_nonfinite = not args.fp16   # a NaN/inf step is never applied; train() stops or skips
        if model.stage3 is not None:               # a forward one rank runs alone fails after this, naming the unit
            model.stage3.gather_timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    options = CheckpointOptions.from_args(args) if options is None else options
    train_state = load_checkpoint(model, optimizer, lr_scheduler, options) if options.load else TrainState()
    resumed = resumed_lr_line(lr_scheduler, train_state.iteration) if train_state.iteration > 0 else None
    if resumed:
        print_rank_0(resumed)
    return model, optimizer, lr_scheduler, train_state


def backward_step(optimizer, model, loss, micro_batch_index, output_grad=None, after_backward=None,
                  num_micro_batches=None):
    """Backward of one micro-batch; after the last one, reduce gradients across data-parallel ranks (and the tied
    word embedding across the first and last pipeline stage), update the fp32 master grads and clip. Returns the
    global gradient norm after the last micro-batch, else None. Pipelining (megatron.pipeline.schedules): before the last
    stage `loss` is the stage's output and `output_grad` the gradient the next stage sent (already scaled);
    `after_backward()` sends this stage's input gradient back, before any reduction. Interleaved, a micro-batch
    has one backward per model chunk: the step's first and last are schedules.backward_position's.
    `num_micro_batches`: the step's (default --global-batch-size's, args.num_micro_batches)."""
    args, timers = get_args(), get_timers()
    num_micro_batches = num_micro_batches or args.num_micro_batches
    first, last = schedules.backward_position(micro_batch_index, num_micro_batches)

    def before_reduce():
        if after_backward is not None:
            after_backward()
        if last:
            schedules.allreduce_embedding_grads(unwrap_model(model))
    if args.deepspeed:
        model.backward(loss, output_grad, before_reduce)  # scales, accumulates, reduces (at the boundary)
        timers("allreduce").reset()
        return None
    if first:
        optimizer.zero_grad()
    # MoE layers' aux losses join backward with the factor the loss gets (mpu/moe.py)
    mpu.set_aux_loss_scale((optimizer.cur_scale if args.fp16 or args.bf16 else 1.0) / num_micro_batches)
    if output_grad is not None:
        torch.autograd.backward(loss, output_grad)
    elif args.fp16 or args.bf16:
        optimizer.backward(loss / num_micro_batches, update_master_grads=False)
    else:
        (loss / num_micro_batches).backward()
    timers("allreduce").start()
    before_reduce()
    if not last:
        timers("allreduce").stop()
        return None
    if args.DDP_impl == "local":
        model.allreduce_params(reduce_after=False, fp32_allreduce=args.fp32_allreduce)
    schedules.finish_deferred_ddp_reduction(model)   # torch DDP under pipelining
    timers("allreduce").stop()
    if args.fp16 or args.bf16:
        optimizer.update_master_grads()
    return schedules.clip_grad_norm(optimizer, unwrap_model(model), args.clip_grad)


def train_step(forward_step_func, data_iterator, model, optimizer, lr_scheduler, num_micro_batches=None):
    """One optimizer step over num_micro_batches micro-batches (default args.num_micro_batches; a ZeRO engine's
    gradient_accumulation_steps must be the same). Returns (losses, skipped_iter, grad_norm)."""
    if get_args().deepspeed:
        return _zero_train_step(forward_step_func, data_iterator, model, optimizer, num_micro_batches)
    return _megatron_train_step(forward_step_func, data_iterator, model, optimizer, lr_scheduler, num_micro_batches)


def _zero_train_step(forward_step_func, data_iterator, model, optimizer, num_micro_batches=None):
    """The engine's recipe: forward, engine.backward and engine.step per micro-batch (the engine reduces,
    steps the optimizer and the lr scheduler at the accumulation boundary)."""
    args, timers = get_args(), get_timers()

    def engine_step():
        timers("optimizer").start()
        model.step()  # a no-op except at the gradient-accumulation boundary
        timers("optimizer").stop()
    losses, _ = _forward_backward(forward_step_func, data_iterator, model, optimizer, engine_step,
                                  num_micro_batches=num_micro_batches)
    losses, grad_norm = _average(losses), model.get_global_grad_norm()
    if not args.fp16 and operations.is_nonfinite([losses], grad_norm):
        param = optimizer.last_nonfinite_param
        name = next((n for n, p in model.module.named_parameters() if p is param), None)
        raise operations.NonFiniteStep(losses, grad_norm, operations.gather_first_name(name))  # skipped
    return losses, int(optimizer.overflow or optimizer.discarded), grad_norm


def _megatron_train_step(forward_step_func, data_iterator, model, optimizer, lr_scheduler, num_micro_batches=None):
    """Megatron's recipe: forward/backward per micro-batch (torch DDP syncs on the last one only), gradients
    reduced and clipped after the last, then the optimizer and (unless fp16 skipped the step) the lr scheduler."""
    args, timers = get_args(), get_timers()
    losses, grad_norm = _forward_backward(forward_step_func, data_iterator, model, optimizer,
                                          num_micro_batches=num_micro_batches)
    losses = _average(losses)
    if not args.fp16 and operations.is_nonfinite([losses], grad_norm):   # fp16: the loss scaler skips overflows
        name = operations.gather_first_name(operations.first_nonfinite_gradient(unwrap_model(model)))
        optimizer.zero_grad()
        raise operations.NonFiniteStep(losses, grad_norm, name)
    timers("optimizer").start()
    took_step = optimizer.step()
    skipped_iter = 0 if took_step is None or took_step else 1
    if not skipped_iter:
        lr_scheduler.step()
    timers("optimizer").stop()
    return losses, skipped_iter, grad_norm


def _forward_backward(forward_step_func, data_iterator, model, optimizer, engine_step=None, forward_only=False,
                      num_micro_batches=None):
    """This step's micro-batches through the schedule (megatron.pipeline.schedules: a plain loop, or 1F1B across pipeline
    stages). Returns (every micro-batch's data-parallel averaged losses, on every rank; the gradient norm from
    backward_step, or None)."""
    args, timers = get_args(), get_timers()
    norms = [None]

    def forward(iterator, module):
        timers("forward").start()
        result = forward_step_func(iterator, module)
        timers("forward").stop()
        return result

    def backward(output, output_grad, micro_batch_index, after_backward):
        timers("backward").start()
        norms.append(backward_step(optimizer, model, output, micro_batch_index, output_grad, after_backward,
                                   num_micro_batches))
        timers("backward").stop()
        if engine_step is not None and schedules.finishes_micro_batch():   # one engine micro-step a micro-batch
            engine_step()
    # with sequence parallelism a stage passes on its rank's sequence slice (Megatron-LM's tensor_shape too)
    # and with context parallelism its 2 chunks of the sequence
    seq = args.seq_length // args.context_parallel_size // (args.model_parallel_size if args.sequence_parallel else 1)
    spec = p2p_communication.TensorSpec((args.batch_size, seq, args.hidden_size),
                                        getattr(torch, args.params_dtype), mpu.get_device())
    losses = schedules.get_forward_backward_func()(forward, data_iterator, model, backward,
                                                   num_micro_batches or args.num_micro_batches,
                                                   spec, forward_only=forward_only)
    return schedules.broadcast_losses_from_last_stage(losses_to_host(losses)), norms[-1]


def losses_to_host(losses):
    """The micro-batches' loss dicts with every tensor value (a 0-d loss, or a (sum, count) pair's members) read
    as a Python float, all in one device-to-host copy: the step's one host sync for its losses, however many
    micro-batches and keys (a forward step returns tensors; `.item()` in each would stall the GPU each time)."""
    tensors = [v for d in losses for value in d.values()
               for v in (value if isinstance(value, tuple) else (value,)) if torch.is_tensor(v)]
    if not tensors:
        return losses
    floats = iter(torch.stack([t.detach().reshape(()).double() for t in tensors]).tolist())

    def host(value):
        if isinstance(value, tuple):
            return tuple(host(v) for v in value)
        return next(floats) if torch.is_tensor(value) else value
    return [{key: host(value) for key, value in d.items()} for d in losses]


def _average(losses):
    """Each key over the micro-batches' loss dicts that have it (train_rlhf.py's PTX micro-batches report their
    own): _combine."""
    keys = dict.fromkeys(key for d in losses for key in d)
    return {key: _combine([d[key] for d in losses if key in d]) for key in keys}


def _combine(values):
    """The mean of the values; for (sum, count) pairs (a token-weighted loss, finetune_gpt.py; Megatron-core's
    convention) the total sum / the total count (0.0 when nothing was counted)."""
    if isinstance(values[0], tuple):
        total, count = sum(v[0] for v in values), sum(v[1] for v in values)
        return total / count if count else 0.0
    return sum(values) / len(values)


def _print_model_state_estimate(model, args):
    """(estimate, its setting): this rank's model-state bytes by kind (operations.model_state_estimate)."""
    module = unwrap_model(model)
    groups = param_groups_for_weight_decay(module)
    if args.optimizer == "muon":       # get_optimizer's halves (the settings do not matter here)
        groups = zero.split_param_groups(module, groups, {"lr": 1.0}, {"lr": 1.0})
    estimate = operations.model_state_estimate(
        [memory.StateGroup(sum(mpu.full_numel(p) for p in group["params"]), mpu.is_expert_parameter(
            group["params"][0]), group.get("use_muon", False)) for group in groups], args, module)
    setting = operations.memory_setting(args)
    print_rank_0(f" > model-state memory estimate per rank (bytes, {setting}): {memory.format_bytes(estimate)}")
    activations, activation_setting = operations.activation_estimate(args)
    print_rank_0(f" > activation memory estimate per rank (bytes, {activation_setting}): {activations} "
                 f"({activations / 2 ** 20:.2f} MiB; the transformer layers, as tools/estimate_memory.py)")
    return estimate, setting


def train(forward_step_func, model, optimizer, lr_scheduler, train_data_iterator, valid_data_iterator, train_state,
          downstream=None, replicas=None):
    """Train from `train_state` (advanced in place) to --train-iters; returns the per-iteration history.
    `downstream`: the --eval-tasks DownstreamEval run every --eval-tasks-interval iterations; `replicas`: the
    replica group's quorum and heals (megatron/trainer/fault_tolerance.py), or None."""
    replicas = replicas if replicas is not None else NoReplicaGroups()
    args, timers = get_args(), get_timers()
    writer = get_tensorboard_writer()
    model.train()
    history = {"iteration": [], "lm loss": [], "loss scale": [], "skipped": [], "grad norm": [], "lr": [], "valid": [],
               "last_saved_iteration": None}
    exit_controller = ExitController(args.exit_interval, args.exit_duration_in_mins, args.exit_signal_handler)
    options = CheckpointOptions.from_args(args)
    interval = IntervalLog(args, timers, writer)
    first_iteration = train_state.iteration + 1
    estimate, setting = _print_model_state_estimate(model, args)
    starving_experts = StarvingExpertWatch(getattr(args, "moe_aux_loss_coeff", 0.0))
    min_scale_watch = operations.MinLossScaleWatch.from_args(args, getattr(optimizer, "cur_scale", 1.0))
    step_watchdog = breadcrumbs.SlowStepWatchdog(args.slow_step_report_factor)
    while train_state.iteration < args.train_iters:
        train_data_iterator = replicas.before_step(train_data_iterator)
        try:
            with step_watchdog.step(train_state.iteration + 1):
                loss_dict, skipped_iter, grad_norm = train_step(forward_step_func, train_data_iterator, model,
                                                                optimizer, lr_scheduler)
        except operations.NonFiniteStep as step:
            message = step.describe(train_state.iteration + 1)
            if not args.skip_nonfinite_steps:
                saved = history["last_saved_iteration"]
                exit_controller.close()
                raise operations.NonFiniteError(f"{message}; stopping without saving (the latest checkpoint stays "
                                     f"{'the one loaded' if saved is None else f'iteration {saved}'}; "
                                     f"--skip-nonfinite-steps skips such steps instead)") from None
            print_rank_0(f" skipped step: {message} (--skip-nonfinite-steps)")
            loss_dict, skipped_iter, grad_norm = step.losses, 1, step.grad_norm
        train_state.iteration += 1
        train_state.consumed_train_samples += args.global_batch_size * args.ft_replica_groups
        train_state.skipped_iterations += skipped_iter
        iteration = train_state.iteration
        replicas.after_step(iteration, history)
        loss_scale = optimizer.cur_scale if args.deepspeed else getattr(optimizer, "loss_scale", 1.0)
        min_scale_watch.check(iteration, skipped_iter, loss_scale, loss_dict, history["last_saved_iteration"],
                              before_raise=exit_controller.close)
        history["iteration"].append(iteration)
        history["lm loss"].append(loss_dict["lm loss"])
        history["loss scale"].append(float(loss_scale))
        history["skipped"].append(skipped_iter)
        history["grad norm"].append(None if grad_norm is None else float(grad_norm))
        history["lr"].append(optimizer.param_groups[0]["lr"])
        if iteration == first_iteration:
            history["model_state_measured"] = operations.measured_model_state(model, optimizer, args)
            print_rank_0(f" > model-state memory measured after step {iteration} (bytes, {setting}): "
                         f"{memory.format_bytes(history['model_state_measured'])}")
            history["model_state_estimate"] = estimate
        interval.add(loss_dict)
        if log_due(iteration, args):
            moe = moe_log_fields(unwrap_model(model))
            interval.log(train_state, optimizer.param_groups[0]["lr"], loss_scale, grad_norm, moe)
            starving = starving_experts.observe(moe, iteration)
            if starving:
                print_rank_0(starving)
        if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid:
            history["valid"].append(evaluate_and_print_results(f"iteration {iteration}", forward_step_func,
                                                               valid_data_iterator, model, train_state))
        if downstream is not None:
            downstream.maybe_run(model, iteration, history)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(train_state, model, optimizer, lr_scheduler, options)
            history["last_saved_iteration"] = iteration
        if exit_controller.should_exit(iteration):
            if interval.iterations:   # an early exit's last iteration is logged too
                interval.log(train_state, optimizer.param_groups[0]["lr"], loss_scale, grad_norm,
                             moe_log_fields(unwrap_model(model)))
            if args.save and history["last_saved_iteration"] != iteration:
                save_checkpoint(train_state, model, optimizer, lr_scheduler, options)
                history["last_saved_iteration"] = iteration
            print_rank_0(f"exiting at iteration {iteration} ({exit_controller.reason})")
            history["exit_reason"] = exit_controller.reason
            break
    exit_controller.close()
    step_watchdog.close()
    return history


def evaluate(forward_step_func, data_iterator, model, train_state):
    """Average 'lm loss' over --eval-iters batches (data-parallel averaged; (sum, count) pairs summed over all the
    batches and divided once: _combine), with dropout off; counts the consumed validation samples in train_state."""
    args = get_args()
    model.eval()
    collected = {}
    with torch.no_grad():
        for _ in range(args.eval_iters):
            for reduced in _forward_backward(forward_step_func, data_iterator, model, None, forward_only=True)[0]:
                for key, value in reduced.items():
                    collected.setdefault(key, []).append(value)
            train_state.consumed_valid_samples += args.global_batch_size
    model.train()
    return {key: _combine(values) for key, values in collected.items()}


def evaluate_and_print_results(prefix, forward_step_func, data_iterator, model, train_state, split="valid"):
    """Evaluate, print the validation line; with --log-jsonl (rank 0) append the same values as a record."""
    args = get_args()
    results = evaluate(forward_step_func, data_iterator, model, train_state)
    record = operations.validation_record(split, prefix, train_state.iteration, results)
    if args.log_jsonl and args.rank == 0:
        operations.write_jsonl_record(args.log_jsonl, record)
    parts = [f"{key} value: {value:.6E}" + (f" | {key} PPL: {record['ppl'][key]:.6E}" if key in record["ppl"] else "")
             for key, value in results.items()]
    line = f" validation loss at {prefix} | " + " | ".join(parts)
    print_rank_0("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
    writer = get_tensorboard_writer()
    if writer is not None:
        for key, value in results.items():
            writer.add_scalar(f"{key} validation", value, train_state.iteration)
    return results

"""An engine's training state as one replica group hands it to another, rank for rank (fault-tolerant replica
groups, megatron/trainer/fault_tolerance.py; torchft's checkpoint transport carries it, no file is written).

Replica groups have the same layout (tensor/pipeline/data-parallel sizes, ZeRO stage), so rank r of one group holds
exactly the partition rank r of another holds: the state is this rank's fp32 master partition (padding included),
its optimizer moments, the optimizer's hyperparameters, the loss scaler, the lr scheduler and the step counters.
The receiving rank copies it in place and publishes the masters into its parameters the way step() does (copy into
the own partition, all-gather within the group), so its weights are bitwise the sender's.

    state = replica_state_dict(engine)          # on the live group's rank r
    load_replica_state_dict(engine, state)      # on the healing group's rank r
"""
import torch


def _clone(value):
    return value.detach().clone() if torch.is_tensor(value) else value


def replica_state_dict(engine):
    """This rank's training state (tensors cloned: the sender trains on while the receiver reads)."""
    optimizer = engine.optimizer
    optimizer.param_gather.wait_all()
    return {"masters": [_clone(master) for master in optimizer.masters],
            "optimizer_state": [{k: _clone(v) for k, v in optimizer._master_state(i).items()}
                                for i in range(len(optimizer.masters))],
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
            "loss_scaler": optimizer.loss_scaler.state_dict(),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps}


def load_replica_state_dict(engine, state):
    """Make this rank's state the sender's (replica_state_dict on the same rank of a group of the same layout);
    every rank of the group calls it (the parameters are all-gathered within the group)."""
    optimizer = engine.optimizer
    optimizer.param_gather.wait_all()
    with torch.no_grad():
        for index, (master, saved) in enumerate(zip(optimizer.masters, state["masters"])):
            if master.shape != saved.shape:
                raise ValueError(f"optimizer group {index}: the peer's master partition has shape "
                                 f"{tuple(saved.shape)}, this rank's {tuple(master.shape)} (another layout)")
            master.copy_(saved)
            optimizer._set_master_state(index, {k: v.to(master.device) if torch.is_tensor(v) else v
                                                for k, v in state["optimizer_state"][index].items()})
        for group, saved in zip(optimizer.param_groups, state["param_groups"]):
            group.update(saved)
        optimizer.loss_scaler.load_state_dict(state["loss_scaler"])
        for group, master in zip(optimizer.groups, optimizer.masters):   # step()'s publication of the masters
            partition = group.own_partition()
            if partition.data_ptr() != master.data_ptr():
                partition.copy_(master)
    optimizer.param_gather.launch()
    optimizer.param_gather.wait_all()
    if engine.stage3 is not None:
        engine.stage3.after_step()
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.set_step_counters(state["global_steps"], state["skipped_steps"])

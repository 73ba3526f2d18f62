"""Which optimizer a checkpoint's state belongs to, AdamW (moments) or Muon (momentum for the hidden matrices,
AdamW for the rest): a run resumed with the other one stops in one line naming both and the fix, instead of failing
on mismatched param groups (same topology) or starting that state from zero (any other topology)."""
from .layout import ADAM_KINDS, MUON_KINDS, CheckpointError


def optimizer_name(param_groups):
    """'Muon' when a param group (torch's, or the hyperparameters a checkpoint keeps) is tagged use_muon, 'AdamW'
    when none is, None when the groups carry no hyperparameters to tell by."""
    if any(group.get("use_muon") for group in param_groups):
        return "Muon"
    return "AdamW" if param_groups and all(param_groups) else None


def switch_error(saved, ours, where=""):
    """The one line for a checkpoint whose optimizer state is `saved`'s ('Muon' or 'AdamW') in a run of `ours`."""
    return CheckpointError(f"{where}the checkpoint's optimizer state is {saved}'s, this run's optimizer is {ours}: "
                           f"resume with --optimizer {'muon' if saved == 'Muon' else 'adam'}, or pass --no-load-optim "
                           f"(or --finetune) to start {ours} fresh from the saved weights")


def check_same_optimizer(saved_groups, our_groups, where):
    """Before a load at the saving topology: the checkpoint's param groups are this run's optimizer's kind."""
    saved, ours = optimizer_name(saved_groups), optimizer_name(our_groups)
    if None not in (saved, ours) and saved != ours:
        raise switch_error(saved, ours, f"{where}: ")


def check_other_optimizer(tensor_of, param, kind):
    """A resharded load found no `kind` for `param`: when the checkpoint holds the other optimizer's state instead
    (switched between AdamW and Muon), say so rather than start that state from zero."""
    other = ADAM_KINDS[0] if kind in MUON_KINDS else MUON_KINDS[0] if kind in ADAM_KINDS else None
    if other is not None and tensor_of(param, other) is not None:
        names = {MUON_KINDS[0]: "Muon", ADAM_KINDS[0]: "AdamW"}
        raise switch_error(names[other], names.get(kind, "AdamW"))

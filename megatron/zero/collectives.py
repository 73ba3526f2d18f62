"""Collectives the engine and activation checkpointing share."""
import torch.distributed as dist


def all_gather_into_tensor(output, tensor, group):
    """Gather every rank's `tensor` into the flat `output` (rank r's piece at [r n, (r+1) n)); `tensor` may be
    output's own piece (in place). all_gather_single where torch has it, all_gather_into_tensor before."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def gather_equal_pieces(pieces, group, per_owner_broadcast=None):
    """pieces[r] (views of one buffer, equal sizes): rank r's filled piece -> every rank (an all-gather in place).
    On gloo, one broadcast per owner instead: gloo's broadcast moves the same bytes several times faster than its
    all-gather (21 MB of fp32 at dp 2 on 2 CPU cores: 9.5 vs 36 ms; at dp 4: 28 vs 50 ms); elsewhere one
    all_gather_into_tensor when the pieces are one contiguous buffer, else the list all_gather.
    per_owner_broadcast: force the choice (None: by the backend)."""
    if per_owner_broadcast is None:
        per_owner_broadcast = dist.get_backend(group) == "gloo"
    if per_owner_broadcast:
        handles = [dist.broadcast(piece, group_src=owner, group=group, async_op=True)
                   for owner, piece in enumerate(pieces)]
        for handle in handles:
            handle.wait()
        return
    rank = dist.get_rank(group)
    first = pieces[0]
    contiguous = all(p.is_contiguous() for p in pieces) and all(
        b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(pieces, pieces[1:]))
    if contiguous:
        flat = first.as_strided((first.numel() * len(pieces),), (1,))
        all_gather_into_tensor(flat, pieces[rank], group)
        return
    dist.all_gather(list(pieces), pieces[rank].clone(), group=group)

"""Muon (MomentUm Orthogonalized by Newton-Schulz, Keller Jordan 2024) with an AdamW half, for whole parameters
and for ZeRO's flat partitions.

The split (DeepSpeed's and the published recipe's): matrices of the hidden layers (>= 2-D, not an embedding or the
output head) step with Muon; embeddings, the head, norms and biases with AdamW. For a Muon matrix W with gradient G:

    B <- beta B + (1 - beta) G                    (momentum buffer; `B.lerp_(G, 1 - beta)`)
    U  = (1 - beta) G + beta B   (Nesterov)  or  B
    O  = NS5(U) * sqrt(max(1, rows / cols))       (Keller Jordan's shape scaling, also DeepSpeed's and torch's
                                                   adjust_lr_fn="original"; not Moonlight's 0.2 sqrt(max) RMS match)
    W <- W (1 - lr wd) - lr O

NS5 is five quintic Newton-Schulz iterations X <- aX + (bA + cA^2)X, A = XX^T, (a, b, c) = (3.4445, -4.7750,
2.0315), on U / ||U||_F (transposed to a wide matrix). "gram" computes the same iteration on the small Gram matrix
(DeepSpeed 0.19.8's default method): mathematically equal, rounding differs.

Sharding: NS needs each whole matrix. Under ZeRO 1-3 the momentum is partitioned like Adam's moments (it is
elementwise), and each rank orthogonalizes only the matrices that overlap its own partition. Those inside it are
whole there; a matrix that crosses a partition boundary is orthogonalized once, by the holder of its largest
piece, which receives the other holders' pieces and sends each its piece of the result (point-to-point over the
data-parallel group, in U's dtype: each rank sends and receives at most the crossing matrices' bytes, at 1.3B a few
matrices, not the whole fp32 U). A tensor-parallel matrix is all-gathered over the model-parallel group along its
split dimension, joined in the single-process order (fused q/k/v and gate/up shards interleave), orthogonalized
whole, and this rank's shard cut out: every rank computes the matrix one process would.
"""
import math

import torch
import torch.distributed as dist

from mpu.utils import full_shape

from .config import ConfigError

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
NS_METHODS = ("standard", "gram")
NOT_MUON_NAMES = ("embed", "lm_head", "output_layer")   # >= 2-D but not hidden matrices: AdamW
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.0, "ns_steps": NS_STEPS,
                 "ns_method": "standard"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}   # MuonWithAuxAdam's


def newton_schulz(matrix, steps=NS_STEPS, method="standard", dtype=torch.float32):
    """NS5(matrix): an approximately orthogonal matrix of the same shape (singular values in about [0.7, 1.2]).
    Normalized in fp32 (fp64 for fp64), iterated in `dtype`, returned in fp32 (fp64)."""
    if method not in NS_METHODS:
        raise ValueError(f"ns_method {method!r} is not one of {NS_METHODS}")
    a, b, c = NS_COEFFICIENTS
    precise = torch.float64 if matrix.dtype == torch.float64 else torch.float32
    wide = matrix.size(0) <= matrix.size(1)
    x = matrix.to(precise) if wide else matrix.to(precise).mT
    x = (x / (x.norm() + NS_EPS)).to(dtype)
    if method == "standard" or x.size(0) == x.size(1):
        for _ in range(steps):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
    else:
        x = _gram_newton_schulz(x, steps, a, b, c)
    x = x.to(precise)
    return x if wide else x.mT


def _gram_newton_schulz(x, steps, a, b, c):
    """The same iteration carried on R = XX^T (n x n, n <= m): X_{k+1} = (aI + Z_k) X_k with Z = bR + cR^2, so
    X_k = Q_k X_0 with Q the product of the (aI + Z), and R_{k+1} = (aI + Z) R (aI + Z) (Z commutes with R). X is
    re-formed once after two iterations (a restart that bounds the rounding Q accumulates)."""
    restart = 2
    r, q = x @ x.mT, None
    for step in range(steps):
        if step == restart:
            x = q @ x
            r, q = x @ x.mT, None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal().add_(a)
        else:
            q = a * q + z @ q
        if step + 1 < steps and step + 1 != restart:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    return q @ x


def shape_scale(rows, cols):
    """Keller Jordan's learning-rate scaling of the orthogonalized update: sqrt(max(1, rows / cols))."""
    return math.sqrt(rows / cols) if rows > cols else 1.0


def ns_dtype(device, method, dtype=torch.float32):
    """fp32 on the CPU (fp64 for fp64 parameters; bf16 is emulated on some CPUs); bf16 (standard) or fp16 (gram,
    DeepSpeed's choice for the Gram form) on accelerators, as published."""
    if device.type == "cpu":
        return torch.float64 if dtype == torch.float64 else torch.float32
    return torch.float16 if method == "gram" else torch.bfloat16


def is_muon_parameter(name, param):
    """The standard split: a matrix (>= 2-D, also while ZeRO-3 holds a flat partition of it) that is not an
    embedding or the output head. An explicit `param.use_muon` (DeepSpeed's attribute) wins."""
    if hasattr(param, "use_muon"):
        return bool(param.use_muon)
    return len(full_shape(param)) >= 2 and not any(key in name.lower() for key in NOT_MUON_NAMES)


def split_param_groups(module, groups, muon, adam):
    """Each incoming param group (dicts, e.g. the weight-decay split; or a list of parameters) in its Muon and AdamW
    halves, tagged `use_muon`; settings most specific last: the half's (`muon` / `adam` dicts), then the group's
    own (DeepSpeed's order).
    `lr_mult` (the schedulers' per-group multiplier, Megatron-LM's name) is muon["lr"] / adam["lr"] on the Muon
    half, so a schedule peaking at adam["lr"] peaks the Muon half at muon["lr"]."""
    names = {id(p): name for name, p in module.named_parameters()}
    groups = list(groups)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    result = []
    for group in groups:
        own = {k: v for k, v in group.items() if k != "params"}
        params = [p for p in group["params"] if p.requires_grad]
        for use_muon, settings in ((True, muon), (False, adam)):
            half = [p for p in params if is_muon_parameter(names.get(id(p), ""), p) is use_muon]
            if half:
                lr_mult = settings["lr"] / adam["lr"] if use_muon else 1.0
                result.append({**settings, **own, "params": half, "use_muon": use_muon, "lr_mult": lr_mult})
    return result


def muon_settings(params):
    """The Muon and AdamW halves' settings from DeepSpeed's optimizer.params: the shared keys each half takes
    (Muon: lr, momentum, weight_decay, ns_method; AdamW: lr, betas, eps, weight_decay), `muon_lr` / `adam_lr`
    over the shared lr, MuonWithAuxAdam's defaults for what is missing."""
    muon = {**MUON_DEFAULTS, **{k: params[k] for k in ("lr", "momentum", "weight_decay", "ns_method") if k in params}}
    adam = {**ADAM_DEFAULTS, **{k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in params}}
    muon["lr"] = params.get("muon_lr", muon["lr"])
    adam["lr"] = params.get("adam_lr", adam["lr"])
    adam["betas"] = tuple(adam["betas"])
    return muon, adam


class MuonError(ConfigError):
    """A Muon setting or combination this codebase does not support (said in one line)."""



def orthogonalized(local, param, group, model_parallel):
    """O for one matrix from its Nesterov update `local` (this rank's tensor-parallel shard when split): the
    shards gathered over `model_parallel` = (group, rank, size) and joined in the single-process order (the
    parameter's partition_stride: fused q/k/v and gate/up interleave blocks, replicated key/value heads are read
    from their first holder), NS5 on the whole matrix, scaled, this rank's shard cut out again."""
    mp_group, mp_rank, mp_size = model_parallel
    split = mp_size > 1 and getattr(param, "model_parallel", False)
    whole = local
    if split:
        parts = [torch.empty_like(local) for _ in range(mp_size)]
        dist.all_gather(parts, local.contiguous(), group=mp_group)
        whole = _join(parts, param)
    matrix = whole.reshape(whole.size(0), -1)
    result = newton_schulz(matrix, group["ns_steps"], group["ns_method"],
                           ns_dtype(matrix.device, group["ns_method"], matrix.dtype))
    result = (result * shape_scale(*matrix.shape)).view(whole.shape)
    if split:
        result = _split(result, param, mp_size, mp_rank)
    return result.to(local.dtype)


def _join(parts, param):
    """The full tensor from every model-parallel rank's shard (the inverse of mpu's split of the master)."""
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    if hasattr(stride, "join"):
        return stride.join(parts, dim)
    blocks = [part.chunk(stride, dim) for part in parts]
    return torch.cat([blocks[rank][j] for j in range(stride) for rank in range(len(parts))], dim)


def _split(full, param, world_size, rank):
    """`rank`'s shard of the full tensor, as mpu splits a master (every world_size-th block of stride x world)."""
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    if hasattr(stride, "split"):
        return stride.split(full, dim, world_size, rank)
    return torch.cat(full.chunk(stride * world_size, dim)[rank::world_size], dim)


def nesterov_update(grad, buffer, group):
    """The momentum step on `buffer` (in place) and the update to orthogonalize; elementwise, so it runs on any
    slice of a parameter (a ZeRO partition)."""
    buffer.lerp_(grad, 1 - group["momentum"])
    return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer.clone()


def partition_update(grad, buffer, layout, group, data_parallel_group, model_parallel):
    """ZeRO: the orthogonalized update of this rank's flat partition `grad` (its own range of `layout`, a
    FlatLayout), momentum `buffer` of the same size stepped in place. A matrix inside this rank's range is whole
    here and orthogonalized in place; a matrix that crosses a partition boundary is orthogonalized by one owner
    (CrossingExchange): its other holders send it their pieces and receive their pieces of the result, in the
    update's dtype. The pieces travel while this rank orthogonalizes the matrices inside its range."""
    update = nesterov_update(grad, buffer, group)
    start, end = layout.own_range
    out = torch.zeros_like(update)
    exchange = CrossingExchange(layout, data_parallel_group)
    wholes = exchange.send_pieces(update)
    for index, _, _ in layout.segments(start, end):
        if index not in exchange.crossing:
            first, last = layout.offsets[index]
            _orthogonalize_into(out, update[first - start:last - start], index, layout, group, model_parallel)
    exchange.wait()
    results = {index: _orthogonalize_into(out, whole, index, layout, group, model_parallel)
               for index, whole in wholes.items()}
    exchange.return_pieces(results, out)
    return out


def _orthogonalize_into(out, whole, index, layout, group, model_parallel):
    """O of parameter `index` from its whole flat update `whole`, this rank's part of it written into `out`;
    returns the whole flat O."""
    param, (first, _) = layout.params[index], layout.offsets[index]
    result = orthogonalized(whole.view(full_shape(param)), param, group, model_parallel).reshape(-1)
    start, end = layout.own_range
    lo, hi = max(start, first), min(end, first + whole.numel())
    out[lo - start:hi - start] = result[lo - first:hi - first]
    return result


def crossing_matrices(layout):
    """{param index: (owner rank, [(rank, lo, hi) of every holder's piece])} of the parameters of `layout` that
    cross a partition boundary (more than one rank holds a piece), in layout order; none at one partition. The
    owner holds the largest piece (the lowest such rank on a tie), so it receives the fewest elements: at 4
    partitions of 64, a 108-element matrix at [40, 148) has pieces 24, 64, 20 on ranks 0, 1, 2 and owner 1."""
    crossing = {}
    if layout.num_partitions > 1:
        for index, (first, last) in enumerate(layout.offsets):
            if last > first and first // layout.partition_size != (last - 1) // layout.partition_size:
                pieces = layout.owners(first, last)
                owner = max(pieces, key=lambda piece: (piece[2] - piece[1], -piece[0]))[0]
                crossing[index] = (owner, pieces)
    return crossing


class CrossingExchange:
    """The two point-to-point rounds that orthogonalize each crossing matrix once, on its owner:

        send_pieces    every other holder sends the owner its piece of the update (one batch_isend_irecv)
        return_pieces  the owner sends every other holder its piece of the result; they receive it in place

    A holder sends and receives its own piece's bytes; an owner receives and sends the rest of its matrix. So each
    rank sends (and receives) at most the crossing matrices' bytes, and nothing travels for a matrix inside a
    partition (the old all-reduce of every crossing matrix sent 2 (n-1)/n of them per rank). Operations on one
    peer are posted in layout order on both sides, so NCCL matches them (it pairs per peer in posting order)."""

    def __init__(self, layout, data_parallel_group):
        self.layout, self.group = layout, data_parallel_group
        self.crossing = crossing_matrices(layout)
        self.handles = []

    def _peer(self, rank):
        return dist.get_global_rank(dist.group.WORLD if self.group is None else self.group, rank)

    def _post(self, ops):
        self.handles = dist.batch_isend_irecv(ops) if ops else []

    def wait(self):
        for handle in self.handles:
            handle.wait()
        self.handles = []

    def send_pieces(self, update):
        """Post round one; returns {index: the whole flat update} of the matrices this rank owns (filled once
        wait() returns)."""
        rank, start = self.layout.rank, self.layout.own_range[0]
        wholes, ops = {}, []
        for index, (owner, pieces) in self.crossing.items():
            first, last = self.layout.offsets[index]
            if owner == rank:
                wholes[index] = update.new_empty(last - first)
            for holder, lo, hi in pieces:
                if holder == rank == owner:
                    wholes[index][lo - first:hi - first] = update[lo - start:hi - start]
                elif owner == rank:
                    ops.append(dist.P2POp(dist.irecv, wholes[index][lo - first:hi - first], self._peer(holder),
                                          self.group))
                elif holder == rank:
                    ops.append(dist.P2POp(dist.isend, update[lo - start:hi - start], self._peer(owner), self.group))
        self._post(ops)
        return wholes

    def return_pieces(self, results, out):
        """Round two, waited for: the owner sends each other holder its piece of `results` ({index: the whole
        flat O} of the matrices this rank owns); a holder receives its piece into its slice of `out`."""
        rank, start = self.layout.rank, self.layout.own_range[0]
        ops = []
        for index, (owner, pieces) in self.crossing.items():
            for holder, lo, hi in pieces:
                if owner == rank != holder:
                    first = self.layout.offsets[index][0]
                    piece = results[index][lo - first:hi - first].contiguous()
                    ops.append(dist.P2POp(dist.isend, piece, self._peer(holder), self.group))
                elif holder == rank != owner:
                    ops.append(dist.P2POp(dist.irecv, out[lo - start:hi - start], self._peer(owner), self.group))
        self._post(ops)
        self.wait()

class Muon(torch.optim.Optimizer):
    """Muon for the param groups tagged `use_muon`, torch's AdamW for the others (one optimizer, one state, one
    learning-rate scheduler: groups carry `lr_mult`). Whole parameters are orthogonalized here (tensor-parallel
    ones gathered over `model_parallel` = (group, rank, size), default mpu's when it is initialized); under the
    ZeRO engine the params are flat fp32 partitions whose gradient already holds the orthogonalized update
    (ZeroOptimizer runs partition_update), so only weight decay and the step are left."""

    def __init__(self, param_groups, model_parallel=None, adam_kernel=None):
        groups = [dict(g) for g in param_groups]
        for group in groups:
            if "use_muon" not in group:
                raise MuonError("every Muon param group needs use_muon (split_param_groups builds them)")
            for key, value in (MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS).items():
                group.setdefault(key, value)
            group.setdefault("lr_mult", 1.0)
            if group["use_muon"] and group["ns_method"] not in NS_METHODS:
                raise MuonError(f"ns_method {group['ns_method']!r} is not supported ({', '.join(NS_METHODS)})")
        super().__init__(groups, {})
        self.model_parallel = model_parallel or _mpu_model_parallel()
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        self.adamw = None
        if adam_groups:
            self.adamw = torch.optim.AdamW(adam_groups, **(adam_kernel or {}))
            self.adamw.param_groups = adam_groups   # the same dicts: a re-pointed group or an lr change is seen
            self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.dim() == 1:    # a ZeRO partition (Muon params are matrices): grad is the update already
                    update = param.grad
                else:
                    state = self.state[param]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(param)
                    update = orthogonalized(nesterov_update(param.grad, state["momentum_buffer"], group), param,
                                            group, self.model_parallel)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param.add_(update.view_as(param), alpha=-group["lr"])
        if self.adamw is not None:
            # load_state_dict replaces the groups and the state: follow them
            self.adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self.adamw.state = self.state
            self.adamw.step()
        return loss


def _mpu_model_parallel():
    import mpu
    if dist.is_available() and dist.is_initialized() and mpu.model_parallel_is_initialized():
        return mpu.get_model_parallel_group(), mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
    return None, 0, 1

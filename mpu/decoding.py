"""Incremental decoding: the keys/values cache (`InferenceCache`, one `LayerPast` per attention layer) and the
weight layouts decoding uses on CPU (decoding_weight_t, decoding_head_matmul).

Pass one `InferenceCache` through `ParallelTransformer.forward(..., inference_cache=cache)` (GPT2Model.forward
does). Each attention layer writes this step's keys/values (its own heads/p heads) into its slot's preallocated
buffers, so a step feeds only the new tokens; `cache.sequence_length` is how many positions are already cached.
Static decoding (`cache.write_at(position)`, what generation's one-token steps use): every step has the same
shapes and reads only fixed buffers, so it can be captured as a CUDA graph: the token's keys/values go to the slot
a device tensor names, and attention reads all `capacity` slots under the caller's mask, which hides the slots not
written yet (and the padding).
"""
import torch


class LayerPast:
    """One attention layer's cached keys and values. The buffers, [b, heads/p, capacity, head_dim] each, are
    allocated at the first write (with that step's batch, dtype and device) and written in place after: no
    reallocation or copy of the past per step.

        slot = LayerPast(capacity=8)
        k, v = slot.append(k3, v3)   # [b, heads/p, 3, d] -> views of positions 0..2
        k, v = slot.append(k1, v1)   # written at position 3 -> views of positions 0..3; slot.length == 4

    Static decoding (`position` set: a long tensor [1] on the device, InferenceCache.write_at): a one-token step
    writes at slot position[0] (index_copy_, no host read) and returns the whole buffers [b, heads/p, capacity,
    head_dim]; the caller's mask hides the slots past it and keeps `length` (InferenceCache.set_length).
    """

    def __init__(self, capacity, transposed=None):
        self.capacity = capacity
        self.key_buffer = None      # [b, heads/p, capacity, head_dim]
        self.value_buffer = None
        self.length = 0             # positions written
        self.transposed = transposed if transposed is not None else {}   # shared by a cache's layers
        self.position = None        # static decoding: a long tensor [1], the slot a one-token step writes

    def weight_t(self, weight):
        """decoding_weight_t of `weight`, made once per cache."""
        return decoding_weight_t(self.transposed, weight)

    def append(self, key, value):
        """Write key/value [b, heads/p, s, head_dim] at positions length..length+s-1; returns the keys and values
        of every position so far, [b, heads/p, length, head_dim] (views of the buffers)."""
        if self.position is not None:
            if self.key_buffer is None or key.size(2) != 1:
                raise ValueError(f"static decoding writes one token per step after a prompt, this step has "
                                 f"{key.size(2)} and {'no' if self.key_buffer is None else 'a'} prompt cached")
            self.key_buffer.index_copy_(2, self.position, key)
            self.value_buffer.index_copy_(2, self.position, value)
            return self.key_buffer, self.value_buffer
        end = self.length + key.size(2)
        if end > self.capacity:
            raise ValueError(f"the inference cache holds {self.capacity} positions, this step needs {end}: make "
                             "the cache with a larger capacity")
        if self.key_buffer is None:
            b, heads, _, head_dim = key.shape
            # zeros, not empty: static decoding reads every slot, and a masked slot's garbage (NaN) would still
            # reach the output through probability 0 x NaN
            self.key_buffer = key.new_zeros(b, heads, self.capacity, head_dim)
            self.value_buffer = value.new_zeros(b, heads, self.capacity, head_dim)
        self.key_buffer[:, :, self.length:end] = key
        self.value_buffer[:, :, self.length:end] = value
        self.length = end
        return self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]


class InferenceCache:
    """Keys/values of every layer for the tokens already processed, up to `capacity` positions (inference only;
    never used in training)."""

    def __init__(self, num_layers, capacity):
        self.transposed = {}             # id(weight) -> its decoding layout (decoding_weight_t)
        self.layers = [LayerPast(capacity, self.transposed) for _ in range(num_layers)]

    def write_at(self, position):
        """Static decoding from now on: each one-token step writes its keys/values at slot position[0] (`position`:
        a long tensor [1] on the cache's device, which the caller updates in place between steps) and attention
        reads every slot, so the caller passes a mask over all `capacity` keys. A prompt is written before
        (plain appends)."""
        for layer in self.layers:
            layer.position = position

    def restart(self):
        """Forget what is cached (keeping the buffers): the next prompt is written from position 0 by plain appends,
        then InferenceCache.write_at again. Returns the cache."""
        for layer in self.layers:
            layer.length, layer.position = 0, None
        return self

    def set_length(self, length):
        """Static decoding: record that `length` positions are cached (the steps do not count, they are replayed
        without the host)."""
        for layer in self.layers:
            layer.length = length

    def head_matmul(self, weight, rows):
        """decoding_head_matmul of the LM head's `weight` for `rows` rows, its layout made once per cache."""
        return decoding_head_matmul(self.transposed, weight, rows)

    @property
    def sequence_length(self):
        """Positions already cached: the next token's position id."""
        return self.layers[0].length if self.layers else 0


ONEDNN_HEAD_MIN_ROWS = 4     # below it MKL's GEMM on the transposed copy is as fast or faster (see below)


def decoding_head_matmul(store, weight, rows):
    """x -> x @ weight^T for the LM head while decoding `rows` rows a step on CPU, its weight layout made once and
    kept in `store`; None where there is none (not on CPU, a ZeRO-3 weight gathered per unit). From
    ONEDNN_HEAD_MIN_ROWS rows on, oneDNN's linear on a weight it packed (torch.ops.mkldnn, where this build has it,
    float32): MKL's GEMM with 4-16 rows and 8192 columns runs 1.5-3x slower than that (one thread, weights out of
    cache, 8192 x 256: 8 rows 2.52 vs 1.38 ms, 4 rows 2.12 vs 0.86 ms), while at 1 or 2 rows its GEMV on the
    transposed copy is faster (0.46 vs 0.81 ms at 1 row). Packing costs about what transposing does. Only without
    autograd (generate runs under no_grad); with it, the transposed copy."""
    if (rows >= ONEDNN_HEAD_MIN_ROWS and weight.dtype == torch.float32 and not torch.is_grad_enabled()
            and _onednn_linear_available()):      # the oneDNN op has no autograd formula
        if not _decodable(weight):
            return None
        key = ("onednn", id(weight))
        if key not in store:
            store[key] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        packed = store[key]
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    weight_t = decoding_weight_t(store, weight)
    return None if weight_t is None else (lambda x: torch.matmul(x, weight_t))


def _onednn_linear_available():
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _decodable(weight):
    """A CPU weight that stays whole for the whole call (not a ZeRO-3 parameter gathered per unit)."""
    manager = getattr(weight, "ds_manager", None)
    return weight.device.type == "cpu" and (manager is None or manager.hooks_bypassed)


def decoding_weight_t(store, weight):
    """A weight [out, in] with out > in (the LM head, q/k/v, the MLP's first linear) transposed into a contiguous
    [in, out] copy for decoding on CPU, kept in `store` (one generation call's cache: the weights do not change
    while decoding); None otherwise. On CPU x W^T with such a W runs a GEMV kernel up to 2.6x slower than
    x (W^T contiguous) (one thread, weights out of cache, batch 1: 8192 x 256 1.13 vs 0.43 ms, 1024 x 256 143 vs
    64 us; the other way round, out < in, it is slower: kept as it is). Not on other devices (cuBLAS takes either
    layout at the same speed), and not for a ZeRO-3 parameter gathered per unit (a whole copy would outlive its
    unit's release; the Hybrid Engine's gathered_for_inference holds them whole anyway)."""
    if not _decodable(weight) or weight.dim() != 2 or weight.size(0) <= weight.size(1):
        return None
    if id(weight) not in store:
        store[id(weight)] = weight.detach().t().contiguous()
    return store[id(weight)]

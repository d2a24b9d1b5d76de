"""Paged stashing (`moe.stash_rows`; Megatron-Core's, docs/moe.md): under the static exchange the experts'
saved activations keep only their valid rows, packed into one pool shared by the MoE layers.

With `moe.exchange = "static"` the experts of every layer get R worst-case rows of which V are
real: a prefix, the rows being grouped by expert with the padding last. The tensors they save
for backward (their input rows, the SwiGLU's gate and up pairs, w2's input, the routing weights) have R
rows each, so a model would hold layers x R rows until backward. Here, while the experts run,
every saved tensor with R rows is written whole into a pool at a device-side offset, rows
[offset, offset + R), and after the layer the offset advances by V: the next layer's tensors
overwrite the padding. A pool of stash_rows + R rows then holds the real rows of every layer in
flight, and nothing leaves the device (the offset and V are device scalars, every shape static).
Backward gathers rows [offset, offset + R) back and zeroes those past V.

One pool per position in the layer's saving order (the i-th tensor its experts save has the
same row width and dtype in every layer); all pools move with the one offset.

Overflow: when the layers in flight need more than stash_rows rows, writes stay inside the pool
(clamped, overwriting earlier stashes) and the most rows needed is kept on the device; `peak()`
hands it over, and the trainer's NaN/Inf guard reads it with its once-per-step check, before the
optimizer step, and stops the run with one line naming moe.stash_rows.

The offset returns to 0 when no stash is outstanding: every stashed tensor freed by autograd
(after its backward, or with its graph), counted on the host.

Under torch.compile the experts' call stays in eager mode (`Stash.call`): the layer compiles to
a graph before the experts and one after. Not under compile.cudagraphs (the configuration
refuses it): the two graphs would be captured and replayed around the eager experts, but CUDA
graph trees record them again whenever a parameter they read moves, and the parameters FSDP2
gathers move with the eager experts' allocations, so most steps record instead of replaying.
"""

import contextlib
import itertools
import weakref

import torch


class Stash:
    """The pools of one model part's MoE layers: stash_rows real rows, plus one layer's R as tail room."""

    def __init__(self, rows: int):
        self.rows = rows
        self.pools: list[torch.Tensor] = []
        self.offset: torch.Tensor | None = None  # [] int64: first free row
        self.needed: torch.Tensor | None = None  # [] int64: most rows the layers in flight needed
        self.outstanding = 0  # stashed tensors not yet freed

    @torch.compiler.disable
    def call(self, valid: torch.Tensor, R: int, fn, *args):
        """fn(*args), the tensors with R rows it saves stashed (layer()). Always in eager mode:
        saved-tensor hooks are Python that torch.compile's graphs cannot hold, so a compiled MoE
        layer runs as two graphs with its experts between them (their GEMMs are few launches)."""
        with self.layer(valid, R):
            return fn(*args)

    @contextlib.contextmanager
    def layer(self, valid: torch.Tensor, R: int):
        """Stash the tensors with R rows that autograd saves inside; valid: [] int64, the real rows V."""
        if self.offset is None:
            self.offset = torch.zeros((), dtype=torch.int64, device=valid.device)
            self.needed = torch.zeros_like(self.offset)
        start = self.offset.clamp(max=self.rows)  # beyond stash_rows: overwrite, flagged by `needed`
        positions = itertools.count()
        # a tensor saved twice (by two ops of the experts) is stashed once; each is held until the
        # layer ends, so that no other tensor takes its memory address meanwhile
        stashed = {}

        def pack(t: torch.Tensor):
            if t.dim() not in (1, 2) or t.shape[0] != R or not t.is_contiguous():
                return t
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            if key not in stashed:
                stashed[key] = (t, self._put(next(positions), t, start, valid))
            return stashed[key][1]

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
        stashed.clear()
        self.offset += valid
        torch.maximum(self.needed, self.offset, out=self.needed)

    def peak(self) -> torch.Tensor:
        """[] int64: the most rows the layers held at once since the last call (then reset)."""
        if self.needed is None:
            return torch.zeros((), dtype=torch.int64)
        peak = self.needed.clone()
        self.needed.zero_()
        return peak

    def _put(self, i: int, t: torch.Tensor, start: torch.Tensor, valid: torch.Tensor) -> "_Stashed":
        R, dtype = t.shape[0], t.dtype
        t = _bytes(t.detach())
        if i == len(self.pools):
            self.pools.append(torch.empty((self.rows + R, *t.shape[1:]), dtype=t.dtype, device=t.device))
        pool = self.pools[i]
        if pool.shape[1:] != t.shape[1:] or pool.dtype != t.dtype or pool.shape[0] < self.rows + R:
            raise RuntimeError(
                f"moe.stash_rows: saved tensor {i} of a layer is {tuple(t.shape)} {t.dtype}, "
                f"its pool {tuple(pool.shape)} {pool.dtype}: every MoE layer must save alike"
            )
        pool.index_copy_(0, start + torch.arange(R, device=t.device), t)
        return _Stashed(self, pool, start, valid, R, dtype)

    def _release(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            assert self.offset is not None  # set by the first save
            self.offset.zero_()


class _Stashed:
    """What autograd keeps of one stashed tensor: where its rows are."""

    def __init__(
        self, stash: Stash, pool: torch.Tensor, start: torch.Tensor, valid: torch.Tensor, R: int, dtype: torch.dtype
    ):
        self.pool, self.start, self.valid, self.R, self.dtype = pool, start, valid, R, dtype
        stash.outstanding += 1
        weakref.finalize(self, stash._release)

    def unpack(self) -> torch.Tensor:
        rows = torch.arange(self.R, device=self.pool.device)
        t = self.pool.index_select(0, self.start + rows)
        padding = (rows >= self.valid).view(-1, *[1] * (t.dim() - 1))
        return t.masked_fill(padding, 0).view(self.dtype)  # rows past V: the padding, or a later layer's rows


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # one-byte dtypes (FP8 experts' rows, masks) travel as uint8: index_copy_ and masked_fill take it on any device
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _unpack(saved):
    return saved.unpack() if isinstance(saved, _Stashed) else saved

"""Gradient compression: codecs for compressed all-reduce, error-feedback state,
and the fused kernels as plain functions.

Codecs (pass one as ``compression=`` to :meth:`pycomm.Communicator.all_reduce`):

* :class:`Int8`, :class:`Int4` — blockwise absmax quantization (one float32
  scale per ``block`` elements), round-to-nearest or unbiased stochastic
  rounding. The all-reduce quantizes each rank's contribution once, reduces in
  float32, and quantizes the reduced shard once (error bound below).
* :class:`TopK` — keep the ``ratio`` largest magnitudes per rank (DGC-style),
  all-gather (value, index) pairs and scatter-add them.

Error feedback: give the call an :class:`ErrorFeedback` and a key (one per
tensor or bucket); what compression dropped this step is added back next step,
so nothing is lost, only delayed (EF-SGD, 1-bit Adam, DGC).

Accuracy contract (tested in tests/test_compression_kernels.py and
tests/test_compressed_collectives.py):

* round-to-nearest: ``|x - D(Q(x))| <= scale / 2`` per element, where
  ``scale = absmax(block) / qmax`` (qmax 127 for int8, 7 for int4), up to
  float32 rounding; stochastic rounding is unbiased.
* NaN and +-Inf come back exactly as NaN and +-Inf (escape codes), never as a
  finite number; they leave a zero residual.
* compressed all-reduce, round-to-nearest: every element is within half a
  scale of each rank's contribution (times 1/world for avg) plus half a scale
  of the reduced value's block, of the exact float64 result (stochastic
  rounding: a full scale each). Measured relative (Frobenius) error on
  Gaussian data: ~1% for Int8, ~18% for Int4 (benchmarks/RESULTS.md). TopK
  returns exactly the sum of what the ranks selected. Every rank gets the
  same bits.

Example::

    comm = pycomm.Communicator()
    ef = pycomm.compression.ErrorFeedback()
    comm.all_reduce(grad, op="avg", compression=pycomm.Int8(), error_feedback=ef, key="layer1")
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, NamedTuple, Optional, Tuple, Union

import torch

from ._loader import load_core
from ._tables import CODECS, codec_default

logger = logging.getLogger("pycomm")

def _core_default(name: str):
    """A dataclass field whose default is the compiled core's (csrc/core/codec.h)."""
    return field(default_factory=lambda: codec_default(name))


class _Codec:
    """What every codec tells the core: its id, looked up by the codec's name.
    A codec checks its parameters when built (the core's rules and words), so
    that a bad one fails where it is written, not at the first backward pass."""

    _name: str

    @property
    def kind(self) -> int:
        """The core's codec id."""
        return CODECS[self._name]

    def __post_init__(self) -> None:
        problem = load_core().codec_problem(*core_args(self))
        if problem:
            raise ValueError(f"pycomm.{problem}")


@dataclass(frozen=True)
class _Quantizer(_Codec):
    block: int = _core_default("block")
    stochastic: bool = _core_default("stochastic")
    seed: int = _core_default("seed")


class Int8(_Quantizer):
    """Blockwise int8 quantization: 4x fewer bytes than float32 (+ 4 bytes per block).

    Example::

        comm.all_reduce(t, compression=pycomm.Int8(block=256, stochastic=False))
    """

    bits = 8
    _name = "int8"


class Int4(_Quantizer):
    """Blockwise int4 quantization (two values per byte): 8x fewer bytes than float32.

    Example::

        comm.all_reduce(t, compression=pycomm.Int4(block=128))
    """

    bits = 4
    _name = "int4"


@dataclass(frozen=True)
class TopK(_Codec):
    """Top-k sparsification: each rank sends its ``ratio`` largest-magnitude entries.

    ``exact=False`` (default) picks a threshold from a sample of
    ``sample_fraction`` of the entries and keeps between ``k`` and
    ``k(1 + tolerance)`` entries: every entry at or above the threshold, so
    always a superset of the exact top-k. Far faster than an exact selection.
    The sample (on CPUs) is runs of 16 neighbouring entries, one at a random
    place in each stretch of the tensor, so that no period of the tensor (the
    rows of a weight's gradient) lines up with it.

    Example::

        comm.all_reduce(grad, op="avg", compression=pycomm.TopK(ratio=0.01), error_feedback=ef, key=0)
    """

    ratio: float = _core_default("ratio")
    exact: bool = _core_default("exact")
    tolerance: float = _core_default("tolerance")
    sample_fraction: float = _core_default("sample_fraction")
    seed: int = _core_default("seed")

    _name = "topk"


Codec = Union[Int8, Int4, TopK]


@functools.lru_cache(maxsize=None)
def codec_dtypes() -> Tuple[torch.dtype, ...]:
    """The dtypes a codec compresses (sum or avg), as the core declares them.

    Example::

        torch.bfloat16 in pycomm.compression.codec_dtypes()   # True
    """
    return tuple(getattr(torch, name) for name in load_core().codec_dtypes)


def is_quantizer(codec: object) -> bool:
    """Whether ``codec`` is :class:`Int8` or :class:`Int4` (which keep a server residual)."""
    return isinstance(codec, _Quantizer)


def is_codec(obj: object) -> bool:
    """Whether ``obj`` is one of the codecs (:class:`Int8`, :class:`Int4`, :class:`TopK`)."""
    return isinstance(obj, (Int8, Int4, TopK))


def plain_allreduce_bytes(numel: int, element_size: int, world: int) -> int:
    """What one rank hands its peers in an uncompressed all-reduce: 2(n-1)/n of the tensor."""
    return 2 * (world - 1) * numel * element_size // world if world > 1 else 0


def core_args(codec: Codec) -> tuple:
    """The codec as the core's compressed all-reduce takes it: (kind, block,
    stochastic, seed, ratio, exact, tolerance, sample_fraction). Parameters a
    codec does not have are the core's defaults."""

    def get(name: str):
        return getattr(codec, name) if hasattr(codec, name) else codec_default(name)

    return (codec.kind, int(get("block")), bool(get("stochastic")), int(get("seed")) & (2**64 - 1),
            float(get("ratio")), bool(get("exact")), float(get("tolerance")), float(get("sample_fraction")))


class _Residuals(NamedTuple):
    worker: torch.Tensor
    server: Optional[torch.Tensor]


class ErrorFeedback:
    """Error-feedback residuals of compressed all-reduces, one set per key.

    Keys name a tensor or a gradient bucket (anything hashable). Each key
    keeps a float32 residual of the tensor's size (what this rank's
    compression dropped) and, for Int8/Int4, one of its reduced shard's size
    (what requantizing the sum dropped, as in 1-bit Adam's server error).
    A key whose tensor changed size or codec starts from zero again; when only
    the reduced shard changed (the world grew or shrank) the worker residual
    stays and the server residual, of another shard layout, restarts.

    Example::

        ef = pycomm.compression.ErrorFeedback()
        for step in range(steps):
            comm.all_reduce(grad, op="avg", compression=pycomm.Int4(), error_feedback=ef, key="fc.weight")
    """

    def __init__(self) -> None:
        self._state: Dict[Hashable, Tuple[tuple, _Residuals]] = {}

    def residuals(self, key: Hashable, tensor: torch.Tensor, codec: Codec, shard_numel: int) -> _Residuals:
        """The residuals for ``key``, created (zero, on the tensor's device) on
        first use or when the layout changed."""
        layout = (tensor.numel(), type(codec).__name__, shard_numel, str(tensor.device))
        entry = self._state.get(key)
        if entry is not None and entry[0] == layout:
            return entry[1]
        if entry is not None and entry[0][:2] + entry[0][3:] == layout[:2] + layout[3:]:
            worker = entry[1].worker  # the shard moved, this rank's own residual did not
        else:
            if entry is not None:
                logger.info("pycomm: error feedback for key %r restarts from zero: layout %s -> %s", key, entry[0],
                            layout)
            worker = torch.zeros(tensor.numel(), dtype=torch.float32, device=tensor.device)
        server = (torch.zeros(shard_numel, dtype=torch.float32, device=tensor.device) if is_quantizer(codec)
                  else None)
        res = _Residuals(worker, server)
        self._state[key] = (layout, res)
        return res

    def state_dict(self) -> Dict[str, Any]:
        """Every key's residuals (tensors on their devices), for a checkpoint.

        Example::

            torch.save(ef.state_dict(), "ef.pt"); ef2.load_state_dict(torch.load("ef.pt"))
        """
        return {"residuals": {key: {"layout": layout, "worker": res.worker, "server": res.server}
                              for key, (layout, res) in self._state.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace every residual with a :meth:`state_dict`'s (copied; moved to
        the device each was saved from when that device exists here)."""
        loaded: Dict[Hashable, Tuple[tuple, _Residuals]] = {}
        for key, e in state["residuals"].items():
            layout = tuple(e["layout"])
            dev = torch.device(layout[3]) if len(layout) > 3 else torch.device("cpu")
            worker = e["worker"].to(dev, torch.float32, copy=True)
            server = None if e["server"] is None else e["server"].to(dev, torch.float32, copy=True)
            loaded[key] = (layout, _Residuals(worker, server))
        self._state = loaded

    def get(self, key: Hashable) -> Optional[_Residuals]:
        """The residuals kept for ``key`` (worker, server), or None if it has none yet."""
        entry = self._state.get(key)
        return None if entry is None else entry[1]

    def reset(self, key: Optional[Hashable] = None) -> None:
        """Forget one key's residuals, or all of them."""
        if key is None:
            self._state.clear()
        else:
            self._state.pop(key, None)

    def keys(self):
        return self._state.keys()

    def __len__(self) -> int:
        return len(self._state)

    def memory_bytes(self) -> int:
        """Bytes held by all residuals."""
        total = 0
        for _, res in self._state.values():
            total += res.worker.numel() * 4 + (res.server.numel() * 4 if res.server is not None else 0)
        return total


# ---------------------------------------------------------------------- kernels


class Quantized(NamedTuple):
    """A blockwise-quantized tensor: ``payload`` holds the scales then the codes."""

    payload: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    block: int

    @property
    def scales(self) -> torch.Tensor:
        """One float32 per block; negative (sign bit set) for blocks holding NaN/Inf."""
        nb = (self.numel + self.block - 1) // self.block
        return self.payload[: nb * 4].view(torch.float32)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)


def _ops():
    load_core()
    return torch.ops.pycomm


def quantize(
    x: torch.Tensor,
    bits: int = 8,
    block: int = 256,
    *,
    stochastic: bool = False,
    seed: int = 0,
    residual: Optional[torch.Tensor] = None,
) -> Quantized:
    """Blockwise absmax quantization of ``x`` (float32/float16/bfloat16).

    With ``residual`` (float32, x.numel() elements), quantizes ``x + residual``
    and stores what rounding lost back into ``residual``, in the same pass.

    Example::

        q = pycomm.compression.quantize(torch.randn(1000), bits=4)
        y = q.dequantize()
    """
    x = x.contiguous()
    payload = _ops().quantize(x.reshape(-1), bits, block, stochastic, seed, residual)
    return Quantized(payload, x.shape, x.dtype, bits, block)


def dequantize(q: Quantized, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The tensor ``q`` encodes, in ``dtype`` (default: the original dtype)."""
    out = _ops().dequantize(q.payload, q.numel, q.bits, q.block, dtype or q.dtype)
    return out.view(q.shape)


def dequantize_accumulate(acc: torch.Tensor, q: Quantized) -> torch.Tensor:
    """``acc += D(q)`` in one pass (float32 arithmetic); returns ``acc``."""
    _ops().dequantize_accumulate(acc.view(-1), q.payload, q.bits, q.block)
    return acc


def dequant_reduce_requant(
    sources: "list[Quantized]",
    dense: Optional[torch.Tensor] = None,
    *,
    post_scale: float = 1.0,
    stochastic: bool = False,
    seed: int = 0,
    residual: Optional[torch.Tensor] = None,
) -> Quantized:
    """``Q((dense + D(s0) + D(s1) + ...) * post_scale + residual)`` in one pass.

    One hop of a compressed ring reduce-scatter is ``dequant_reduce_requant([received], own_chunk)``;
    no full-precision copy of the chunk is ever materialised.
    """
    if not sources and dense is None:
        raise ValueError("dequant_reduce_requant needs at least one source or a dense tensor")
    ref = sources[0] if sources else None
    bits = ref.bits if ref else 8
    block = ref.block if ref else 256
    numel = ref.numel if ref else dense.numel()
    shape = ref.shape if ref else dense.shape
    dtype = ref.dtype if ref else dense.dtype
    for s in sources:
        if (s.bits, s.block, s.numel) != (bits, block, numel):
            raise ValueError("dequant_reduce_requant: sources differ in bits, block or size")
    payload = _ops().dequant_reduce_requant(
        [s.payload for s in sources], None if dense is None else dense.contiguous().view(-1), numel, bits, block,
        float(post_scale), stochastic, seed, residual)
    return Quantized(payload, shape, dtype, bits, block)


class Sparse(NamedTuple):
    """Top-k selection: ``values`` and int32 ``indices`` (ascending) are views of one ``buffer``."""

    buffer: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    shape: torch.Size

    def to_dense(self) -> torch.Tensor:
        """The dense tensor of ``shape`` holding the selected entries, on the values' device."""
        out = torch.zeros(self.shape, dtype=self.values.dtype, device=self.values.device).view(-1)
        scatter_add(out, self.values, self.indices)
        return out.view(self.shape)


def topk(
    x: torch.Tensor,
    k: int,
    *,
    exact: bool = False,
    tolerance: float = 0.1,
    sample_fraction: float = 0.01,
    seed: int = 0,
    residual: Optional[torch.Tensor] = None,
) -> Sparse:
    """The ``k`` largest-magnitude entries of ``x`` (NaN counts as largest).

    ``exact=True`` keeps exactly ``min(k, numel)`` (ties to the lower index);
    otherwise between ``k`` and ``k(1 + tolerance)``, a superset of the exact top-k. With
    ``residual`` (float32), selects from ``x + residual`` and leaves there
    whatever was not sent.

    Example::

        s = pycomm.compression.topk(torch.randn(1 << 20), k=10_000)
        dense = s.to_dense()
    """
    x = x.contiguous()
    buf, count, cap = _ops().topk(x.view(-1), int(k), exact, float(tolerance), float(sample_fraction), seed,
                                  residual)
    values, indices = topk_entries(buf, count, cap, x.dtype)
    return Sparse(buf, values, indices, x.shape)


def topk_entries(buf: torch.Tensor, count: int, cap: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` (values, int32 indices) of a top-k buffer of capacity
    ``cap``, as views: the values in ``dtype`` padded to 8 bytes, then the indices."""
    es = torch.empty((), dtype=dtype).element_size()
    vbytes = (cap * es + 7) // 8 * 8
    return buf[: cap * es].view(dtype)[:count], buf[vbytes: vbytes + cap * 4].view(torch.int32)[:count]


def scatter_add(dense: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``dense.view(-1)[indices[j]] += values[j]`` (float32 arithmetic); returns ``dense``.

    Raises on an index outside the tensor.
    """
    _ops().scatter_add(dense.view(-1), values.contiguous(), indices.contiguous())
    return dense

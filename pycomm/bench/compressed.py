"""Compressed all-reduce rows of pycomm-bench (``--compression int8,int4,topk``).

A compressed call is lossy, so its ``#wrong`` is not a comparison with a
closed form: each element is checked against the accuracy the codec promises
(:mod:`pycomm.compression`), on Gaussian data that every rank draws from its
own seed (quantizing the benchmark's small-integer pattern would be exact and
prove nothing):

* Int8 / Int4 (round to nearest): within half a scale of every rank's
  contribution plus half a scale of the reduced value's block, of the float64
  result (a full scale each with stochastic rounding).
* TopK: exactly the sum of what the ranks selected, and each rank's selection
  is a threshold set of k entries (the largest magnitudes; up to
  ``k(1 + tolerance)`` when the threshold is sampled). What a rank selected is read from the error-feedback residual
  of the checked call (``x - residual``); the timed calls carry none, and their
  threshold's sample is drawn anew every call, so their selections differ.

Times and bandwidths are those of the uncompressed tensor (what the caller's
gradient moved), so that the rows read against the exact algorithms' and the
baseline's; ``wire_bytes`` in the JSON rows is what each rank sent, and
``plain_bytes`` what it would send uncompressed.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

import pycomm
from pycomm import compression
from pycomm._loader import load_core

_NAMES = ("int8", "int4", "topk")


def parse_codec(spec: str) -> "compression.Codec":
    """``int8``, ``int8:64`` (block), ``int4``, ``int4:128:stochastic``, ``topk``, ``topk:0.001`` (ratio),
    ``topk:0.01:exact``.

    Example::

        parse_codec("int4:64")    # pycomm.Int4(block=64)
    """
    name, *params = spec.strip().lower().split(":")
    if name not in _NAMES:
        raise ValueError(f"unknown codec {spec!r} (use {', '.join(_NAMES)}, e.g. int8:256 or topk:0.01)")
    flags = {p for p in params if p in ("stochastic", "exact")}
    numbers = [p for p in params if p not in flags]
    if len(numbers) > 1 or (name == "topk" and "stochastic" in flags) or (name != "topk" and "exact" in flags):
        raise ValueError(f"bad codec {spec!r} (e.g. int8:256, int4:64:stochastic, topk:0.01, topk:0.01:exact)")
    try:
        if name == "topk":
            ratio = float(numbers[0]) if numbers else None
            kwargs = {"exact": "exact" in flags}
            if ratio is not None:
                kwargs["ratio"] = ratio
            return pycomm.TopK(**kwargs)
        kwargs = {"stochastic": "stochastic" in flags}
        if numbers:
            kwargs["block"] = int(numbers[0])
        return (pycomm.Int8 if name == "int8" else pycomm.Int4)(**kwargs)
    except ValueError as e:
        raise ValueError(f"bad codec {spec!r}: {e}") from None


def codec_label(codec: "compression.Codec") -> str:
    """The row's name: ``int8(b256)``, ``int4(b64,sr)``, ``topk(1%)``, ``topk(0.1%,exact)``."""
    if compression.is_quantizer(codec):
        return f"int{codec.bits}(b{codec.block}{',sr' if codec.stochastic else ''})"
    return f"topk({codec.ratio * 100:g}%{',exact' if codec.exact else ''})"


class CompressedCase:
    """One size of a compressed all-reduce: a fixed random input per rank and
    an output buffer (the timed calls never change the input, so every call
    compresses the same data), checked against the codec's accuracy."""

    def __init__(self, comm: "pycomm.Communicator", codec: "compression.Codec", size: int, dtype: torch.dtype,
                 op: str) -> None:
        self.comm, self.codec, self.op, self.dtype = comm, codec, op, dtype
        esize = torch.empty((), dtype=dtype).element_size()
        self.count = self.elements = max(size // esize, 1)
        self.size_bytes = self.count * esize
        gen = torch.Generator().manual_seed(7919 * (comm.rank + 1))
        self.inp = torch.randn(self.count, generator=gen).to(dtype)
        self.out = torch.empty_like(self.inp)
        self.wire_bytes = self.plain_bytes = 0

    def call(self) -> Callable[[], None]:
        return lambda: self.comm.all_reduce(self.inp, self.op, output=self.out, compression=self.codec)

    def fill(self) -> None:
        self.out.fill_(float("nan"))

    def wrong(self) -> int:
        """Elements of this rank outside the codec's promise (collective: every rank calls it)."""
        if compression.is_quantizer(self.codec):
            self._checked_call()
            return self._wrong_quantized()
        return self._wrong_topk()

    def _checked_call(self, **kwargs) -> None:
        work = self.comm.all_reduce(self.inp, self.op, output=self.out, compression=self.codec, async_op=True,
                                    **kwargs)
        work.wait()
        self.wire_bytes, self.plain_bytes = int(work.bytes_sent), int(work.bytes_uncompressed)

    def _mean(self, t: torch.Tensor) -> torch.Tensor:
        return t / self.comm.world_size if self.op == "avg" else t

    def _exact(self, t: torch.Tensor) -> torch.Tensor:
        total = t.double()
        self.comm.all_reduce(total)
        return self._mean(total)

    def _wrong_quantized(self) -> int:
        c = self.codec
        # Scales come from the extension's own quantizer: the sum over ranks of
        # each block's scale bounds the contributions' rounding.
        contrib = compression.quantize(self.inp, c.bits, c.block).scales.double()
        self.comm.all_reduce(contrib)
        exact = self._exact(self.inp)
        # The reduced value the last quantization sees is the exact one off by
        # the contributions' rounding, and so may be its block's absmax: its
        # scale is at most the exact value's plus that error over qmax.
        inv_qmax = float(compression.quantize(torch.ones(c.block), c.bits, c.block).scales[0])
        rounding = 1.0 if c.stochastic else 0.5  # of a scale, per quantization
        contrib_err = self._mean(contrib) * rounding
        result_scale = compression.quantize(exact.float(), c.bits, c.block).scales.double()
        per_block = contrib_err + (result_scale + contrib_err * inv_qmax) * rounding
        bound = per_block.repeat_interleave(c.block)[: self.count]
        return self._count_outside(exact, bound)

    def _wrong_topk(self) -> int:
        # The threshold comes from a sample drawn anew for every call, so
        # only a call whose selections are known can be checked: this one.
        ef = compression.ErrorFeedback()
        self._checked_call(error_feedback=ef, key="check")
        residual = ef.get("check").worker
        x = self.inp.float()
        sent = x - residual
        chosen = sent != 0
        # A selection sends an entry whole or not at all.
        wrong = int((chosen & (residual != 0)).sum() + (~chosen & (residual != x)).sum())
        # ... k of them (the core's k for this ratio; up to its capacity when
        # the threshold is sampled), every one at least as large as any left out.
        core, c = load_core(), self.codec
        k = int(core.topk_entries(self.count, float(c.ratio)))
        most = k if c.exact else int(core.topk_capacity(k, self.count, False, float(c.tolerance)))
        kept, left = x[chosen].abs(), x[~chosen].abs()
        if not k <= kept.numel() <= most or (kept.numel() and left.numel() and left.max() > kept.min()):
            wrong += 1
        exact = self._exact(sent)
        magnitude = self._exact(sent.abs().double())
        # float32 sums of at most world_size terms.
        bound = magnitude * (self.comm.world_size * 2.0 ** -24)
        return self._count_outside(exact, bound)

    def _count_outside(self, exact: torch.Tensor, bound: torch.Tensor) -> int:
        # Half a unit in the last place of the output dtype: the rounding of
        # the float32 result into the caller's tensor.
        slack = (exact.abs() + bound) * (torch.finfo(self.dtype).eps / 2) + 1e-30
        err = (self.out.double() - exact).abs()
        return int((~(err <= bound * (1 + 1e-6) + slack)).sum())


def compressed_runs(comm: "pycomm.Communicator", codecs: List["compression.Codec"], size: int,
                    dtype: torch.dtype, op: str) -> List[tuple]:
    """The (backend, label, case, timed call) entries of one size."""
    runs = []
    for codec in codecs:
        case = CompressedCase(comm, codec, size, dtype, op)
        runs.append(("pycomm", codec_label(codec), case, case.call()))
    return runs


def check_options(codecs: Optional[List[str]], collective: str, op: str, dtype: torch.dtype) -> List:
    """Parsed codecs, or SystemExit with what is wrong with the command line."""
    if not codecs:
        return []
    if collective != "all_reduce":
        raise SystemExit("pycomm-bench: --compression runs the compressed all-reduce (-c all_reduce only)")
    if op not in ("sum", "avg"):
        raise SystemExit("pycomm-bench: --compression sums or averages (-o sum or -o avg)")
    if dtype not in compression.codec_dtypes():
        names = ", ".join(str(d).replace("torch.", "") for d in compression.codec_dtypes())
        raise SystemExit(f"pycomm-bench: --compression takes {names} tensors")
    try:
        return [parse_codec(s) for s in codecs]
    except ValueError as e:
        raise SystemExit(f"pycomm-bench: {e}") from None

"""Weight-only quantization (`--quantization int8|int4|fp8`): smaller weights, same activations.

A decode step reads every weight once, so on a CPU its time is weight bytes over memory
bandwidth: int8 halves the bytes of bf16, int4 quarters them. Weights are quantized once at
load, after tensor-parallel sharding, and multiplied by torch's CPU weight-only kernels:
- int8: one symmetric scale per output row (-127..127; `_weight_int8pack_mm`). With AMX and bf16
  activations, batches of up to 64 rows instead stream the int8 weight through AMX tiles
  (csrc `skinny_int8`: a decode step of SmolLM2 reads 135 MB instead of 270), and larger ones
  (prefill) multiply a oneDNN-packed bf16 copy of the dequantized weight: torch's int8 kernel
  is far slower than oneDNN there (docs/benchmarks.md#fig-neuron-quant).
- fp8: float8_e4m3fn codes with one scale per output row (layers/fp8.py: native skinny kernel
  for decode batches, the dequantized weight above them).
- int4: asymmetric groups of 32 input columns with a scale and a zero point each, as GGUF's
  Q4_1 does (`_weight_int4pack_mm_for_cpu`, which dequantizes `(q - 8) * scale + zero`).
Only the dense linears and the LM head are quantized; the embedding table is looked up, not
multiplied, and MoE experts keep their format. Outputs are approximate by construction:
`axonserve validate` measures how far they drift from the unquantized model.
"""

from __future__ import annotations

import functools
import os

import structlog
import torch
from torch import nn

from axonserve.config import QUANTIZATIONS
from axonserve.neuron.layers import fp8

log = structlog.get_logger()

INT4_GROUP = 32


class QuantizedWeight:
    """A [N, K] weight in a packed low-bit format; `matmul(x)` is x @ W^T."""

    def __init__(self, w: torch.Tensor, method: str, act_dtype: torch.dtype):
        w = w.float()
        self.method, self.shape = method, tuple(w.shape)
        n, k = w.shape
        self.skinny: torch.Tensor | None = None  # int8 in the AMX layout (skinny_int8)
        self.skinny_rows = 0
        if method == "int8":
            scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
            self.scales = scale.to(act_dtype)
            self.data: torch.Tensor | None = q
            if act_dtype == torch.bfloat16:
                self._amx_int8(q, scale)
        elif method == "fp8":
            self.data, self.scales = fp8.quantize_weight(w)  # scales stay float32 (applied to the sums)
        elif method == "int4":
            if k % INT4_GROUP:
                raise ValueError(f"int4 needs the input size ({k}) to be a multiple of {INT4_GROUP}")
            g = w.reshape(n, k // INT4_GROUP, INT4_GROUP)
            lo, hi = g.amin(dim=-1), g.amax(dim=-1)
            scale = ((hi - lo) / 15.0).clamp(min=1e-12)
            q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
            self.data = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            # [K/group, N, 2]: (scale, zero) with zero = lo + 8 * scale for the kernel's (q - 8)
            self.scales = torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(act_dtype)
        else:
            raise ValueError(f"quantization {method!r} is not supported; supported: {', '.join(QUANTIZATIONS)}")

    def _amx_int8(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Where AMX takes the weight (K a multiple of 32): the int8 copy in skinny_int8's layout
        for up to 64 rows, and `data` becomes the dequantized bf16 weight in oneDNN's layout."""
        kernels = _skinny_kernels(q) if can_pack(torch.bfloat16) and q.shape[1] % 32 == 0 else None
        packed = kernels.pack_int8_weight(q) if kernels is not None else None
        rows = kernels.skinny_rows(packed) if packed is not None else 0
        if rows == 0:
            return
        self.kernels, self.skinny, self.skinny_rows = kernels, packed, rows
        self.skinny_scales = scale.contiguous()
        self.data = torch.ops.mkldnn._reorder_linear_weight((q.float() * scale[:, None]).bfloat16(), 32)

    @property
    def nbytes(self) -> int:
        parts = [t for t in (self.data, self.scales, self.skinny) if t is not None]
        return sum(t.numel() * t.element_size() for t in parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == "fp8":
            return fp8.matmul(x, self.data, self.scales)
        x = x.to(self.scales.dtype)
        if self.skinny is not None:
            if x.shape[0] <= self.skinny_rows and x.dim() == 2 and x.stride(-1) == 1:
                return self.kernels.skinny_int8(x, self.skinny, self.skinny_scales)
            return onednn_matmul(x, self.data)
        if self.method == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.data, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.data, INT4_GROUP, self.scales)


class PackedWeight:
    """A bf16 weight reordered once into oneDNN's blocked layout (what inductor's CPU freezing
    does): a plain bf16 gemm re-packs the weight on every call, which made a batch-32 SmolLM2
    step's matmuls markedly slower (same products, bit for bit; docs/benchmarks.md#fig-neuron-quant).
    Products of 128+ rows a thread may run with the rows split between the threads where oneDNN
    threads the shape poorly (`onednn_matmul`): within one bf16 rounding of oneDNN's own.

    With AVX512-BF16 a second copy in the native skinny layout serves calls of up to
    `skinny_rows` rows (128: a decode batch, a verification; on AMX tiles, else on the
    dot-product loop): oneDNN's brgemm streams the weight at about half the memory bandwidth at
    the small sizes, and without AMX runs further from the dot product's peak up to ~64 rows;
    above that (prefill) oneDNN's blocking wins. Those products
    accumulate in float32 in another order (bf16 results within one rounding of oneDNN's).
    The copy doubles the weights' memory; AXONSERVE_GEMV=0 leaves it out."""

    method = "packed"

    def __init__(self, w: torch.Tensor, code: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.shape = tuple(w.shape)
        self.nbytes = w.numel() * w.element_size()
        # a CPU without oneDNN's bf16 path (no AVX512-BW/VL/DQ nor AVX-NE-CONVERT) keeps the
        # dense weight: torch's own bf16 linear, slower but exact to the same rounding
        self.onednn = onednn_bf16()
        self.data = (
            torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 32) if self.onednn else w.contiguous()
        )  # (32: the batch oneDNN's layout is tuned for)
        self.kernels = _skinny_kernels(w) if self.onednn else None
        self.skinny = self.kernels.pack_gemv_weight(w.contiguous()) if self.kernels is not None else None
        self.skinny_rows = self.kernels.skinny_rows(self.skinny) if self.skinny is not None else 0
        if self.skinny is not None:
            self.nbytes *= 2
        # `code`: w's GGUF block codes (code_copy, fitted as the weights loaded: loader.fit_twins),
        # a third copy, which the fewest-row steps stream instead (5 / 9 bits a weight, same bits)
        self.code_rows = self.kernels.code_rows() if self.skinny is not None and code is not None else 0
        self.codes, self.code_scales = code if self.code_rows else (None, None)
        if self.code_rows:
            self.nbytes += sum(t.numel() * t.element_size() for t in code)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.codes is not None and x.shape[0] <= self.code_rows and x.dim() == 2 and x.stride(-1) == 1:
            return self.kernels.qdot_bf16(x, self.codes, self.code_scales)
        if x.shape[0] <= self.skinny_rows and x.dim() == 2 and x.stride(-1) == 1:
            return self.kernels.skinny_bf16(x, self.skinny)
        if not self.onednn:
            return torch.nn.functional.linear(x, self.data)
        return onednn_matmul(x, self.data)


def onednn_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ W^T through oneDNN's bf16 matmul on a reordered weight; with the native kernels, rows
    split between the threads for the shapes oneDNN threads poorly (cpu_kernels.cpp `onednn_linear`)."""
    from axonserve.neuron.ops import native

    k = native.kernels()
    if k is not None:
        return k.onednn_linear(x.contiguous(), packed)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


def settle_onednn_split(model: torch.nn.Module, max_rows: int) -> int:
    """Make `onednn_linear`'s per-bucket choice (oneDNN's threading or the rows split between the
    threads) for every oneDNN weight shape of the model and every row bucket up to max_rows now,
    at start-up, instead of in the first served product of each bucket: measuring computes that
    product 8-14 times (a wave's prefill paid ~10-40 ms a new bucket in its TTFT). Returns the
    products run (0: no native kernels, one thread, or AXONSERVE_ONEDNN_SPLIT set)."""
    from axonserve.neuron.ops import native

    k = native.kernels()
    if k is None:
        return 0
    shapes: dict[tuple[int, ...], torch.Tensor] = {}
    for m in model.modules():
        q = getattr(m, "qweight", None)
        if isinstance(q, (PackedWeight, QuantizedWeight)) and q.data.layout == torch._mkldnn:  # oneDNN's layout
            shapes.setdefault(tuple(q.data.shape), q.data)
    return sum(k.onednn_settle(w, max_rows) for w in shapes.values())


class PanelWeight:
    """A weight for float32 activations on an AVX2 + FMA CPU (AVX-512 ones too), in the native
    `panel_linear` layout ([N/16, K, 16] strips). MKL's float32 GEMM runs decode-sized products
    far below the CPU's peak (SmolLM2's 121 decode matmuls on the AMD EPYC: 36 ms at 1 row, 107 ms
    at 32, against 10-17 and 52-57 here; docs/benchmarks.md#fig-panel-gemm). The weight keeps its exact
    values in the fewest bytes that hold them, since a 1-row step waits for the bytes:
    - block codes (`block_codes`): a GGUF Q4_1 / Q8_0 weight dequantized to float32 by the
      converter is re-encoded to its 4- / 8-bit codes and float16 scales, bit for bit (the
      default SmolLM2's layers are Q4_1, its embedding Q8_0: ~5x fewer bytes than float32);
    - bf16 where every value is a bf16 (a bf16 checkpoint served in float32);
    - float32 otherwise.
    Products accumulate in float32 in another order than MKL's (within float32 rounding of it).
    AXONSERVE_PANEL=0 leaves MKL in charge.

    int8_activations (`--activation-quantization int8`, opt-in): block codes are kept in
    `dot_linear_codes`' layout and multiplied by the activations rounded to int8 per block of 32,
    in integers (llama.cpp's Q8_1 arithmetic): not exact, ~1.5x faster (docs/benchmarks.md)."""

    method = "panel"

    def __init__(self, w: torch.Tensor, kernels, int8_activations: bool = False):
        self.shape = tuple(w.shape)
        self.kernels = kernels
        self.int8_activations = False
        w = w.float()
        coded = block_codes(w)
        if coded is not None:
            self.data, self.d, self.m = coded
            self.format = "q4" if self.data.dtype == torch.uint8 else "q8"
            if int8_activations:
                if self.format == "q8" and self.m.any():  # (the 8-bit dot kernel has no offset term)
                    raise ValueError("8-bit block codes with an offset cannot multiply int8 activations")
                self.data, self.int8_activations = kernels.pack_dot_codes(self.data), True
        else:
            wb = w.bfloat16()
            exact = torch.equal(wb.float(), w)
            self.data, self.d, self.m = kernels.pack_panels(wb if exact else w.contiguous()), None, None
            self.format = "bf16" if exact else "float32"
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.data, self.d, self.m) if t is not None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.matmul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.shape[0])
        if self.int8_activations:
            return self.kernels.dot_linear_codes(x.float(), self.data, self.d, self.m).to(x.dtype)
        if self.d is not None:
            return self.kernels.panel_linear_codes(x.float(), self.data, self.d, self.m).to(x.dtype)
        return self.kernels.panel_linear(x.float(), self.data).to(x.dtype)


def block_fit(
    w: torch.Tensor, ref: torch.Tensor | None = None
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """float32 [N, K] -> (bits, q int8 [N, K], d, m float32 [N, K/32]) when every block of 32 inputs
    of every row is exactly fma(q, d, m) with float16 d, m and 4-bit q >= 0 (GGUF Q4_1: the block's
    minimum is m, its maximum 15 d + m; bits 4) or exactly q d with 8-bit q (Q8_0: its largest
    magnitude is 127 |d|; bits 8, m 0); else None. `ref` (bf16): each value's rounding must also
    be ref's bits. The native `fit_codes` decodes every value again in the same pass (one pass, no
    temporaries: SmolLM2's 135M values in a fraction of a second), so None is the only way wrong
    codes could come back; without the native kernels (which every code path needs) None."""
    from axonserve.neuron.ops import native

    k = native.kernels()
    if k is None or not hasattr(k, "fit_codes"):
        return None
    bits, q, d, m = k.fit_codes(w.float().contiguous(), None if ref is None else ref.contiguous())
    return (bits, q, d, m) if bits else None


def block_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """float32 [N, K] -> (codes, d, m) in panel_linear_codes' layout when `block_fit` finds codes."""
    fit = block_fit(w)
    if fit is None:
        return None
    bits, q, d, m = fit
    if bits == 4:
        q = _panels(q).to(torch.uint8)  # [N/16, K, 16]
        return (q[..., :8] | (q[..., 8:] << 4)).contiguous(), _panels(d.half()), _panels(m.half())  # c low, c + 8 high
    return _panels(q), _panels(d.half()), _panels(m.half())


def code_copy(exact: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes, scales) in qdot_bf16's layout (cpu_kernels.cpp) for a bf16 weight `w` loaded by
    rounding the float32 `exact`, when `exact` is GGUF block codes (block_fit) and their rounding is
    `w` bit for bit; else None. The kernel rebuilds each value as fma(q, d, m) in float32, rounded
    to bf16: the very weight the skinny bf16 copy holds."""
    fit = block_fit(exact, w)
    if fit is None:
        return None
    from axonserve.neuron.ops import native

    bits, q, d, m = fit
    return native.kernels().pack_codes(q, d, m, bits)


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [N/16, C, 16]: 16 output rows side by side per step."""
    n, c = t.shape
    return t.reshape(n // 16, 16, c).transpose(1, 2).contiguous()


def panel_kernels(dtype: torch.dtype):
    """The native module where float32 linears should run on panels (PanelWeight), else None."""
    from axonserve.neuron.ops import native

    if dtype != torch.float32 or os.environ.get("AXONSERVE_PANEL", "1") in ("0", "false", "no"):
        return None
    k = native.kernels()
    return k if k is not None and k.has_panel_gemm() else None


def panels_serve(dtype: torch.dtype, int8_activations: bool = False) -> bool:
    """Whether load_model gives float32 linears PanelWeights: always on AVX2 CPUs; on AVX-512 ones
    only with int8 activations. There MKL's AVX-512 GEMM multiplies prefill-sized inputs 2-3x
    faster than the AVX2 panels (1,024 rows; docs/benchmarks.md#fig-amx-int8-act), which the
    panels' decode gain does not pay for; the int8 dot products keep up with it."""
    if panel_kernels(dtype) is None:
        return False
    return int8_activations or torch.backends.cpu.get_cpu_capability() != "AVX512"


def _skinny_kernels(w: torch.Tensor):
    """The native module when it can take `w` in the skinny-matmul layout, else None."""
    from axonserve.neuron.ops import native

    if os.environ.get("AXONSERVE_GEMV", "1") in ("0", "false", "no") or w.dim() != 2:
        return None
    k = native.kernels()
    if k is None or not k.has_bf16_gemv():  # the build is keyed by the source: it always has the call
        return None
    return k if w.shape[0] % 16 == 0 and w.shape[1] % 2 == 0 else None


@functools.cache
def onednn_bf16() -> bool:
    """oneDNN can hold bf16 weights in its packed layout on this CPU (AVX512-BW/VL/DQ or
    AVX-NE-CONVERT; not on AVX2-only machines)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and onednn_bf16()


def quantize_model(model: nn.Module, method: str, act_dtype: torch.dtype, int8_activations: bool = False) -> None:
    """Give every module with a `quantizable` weight a `qweight` (a low-bit format; with method
    "packed" the bf16 weight in oneDNN's layout, with "panel" float32 panels, block codes times int8
    activations with int8_activations) and drop its dense weight (tied LM heads keep the embedding's
    table for lookups and get their own packed copy)."""
    shared = {
        id(p) for m in model.modules() if not getattr(m, "quantizable", False) for p in m.parameters(recurse=False)
    }
    panels = panel_kernels(act_dtype) if method == "panel" else None
    before = after = 0
    for m in model.modules():
        if not getattr(m, "quantizable", False):
            continue
        w = m.weight
        if method == "panel":
            if panels is None or w.dim() != 2 or w.shape[0] % 16:
                continue  # (a shard with a row count the panels do not tile stays dense)
            m.qweight = PanelWeight(w.data, panels, int8_activations)
        elif method == "packed":
            m.qweight = PackedWeight(w.data, w.__dict__.pop("code_copy", None))
        else:
            m.qweight = QuantizedWeight(w.data, method, act_dtype)
        before += w.numel() * w.element_size()
        after += m.qweight.nbytes
        if id(w) not in shared:
            m.weight = None  # the dense copy is no longer used: give its memory back
    _streamed_into_huge_pages(model)
    log.info("model.quantized", method=method, mib_before=round(before / 2**20, 1), mib_after=round(after / 2**20, 1))


def _streamed_into_huge_pages(model: nn.Module) -> None:
    """The weights every decode step reads whole (skinny copies, else int8/int4 data) move into one
    huge-page buffer (heap.huge_page_copies); prefill's oneDNN copies stay (compute-bound)."""
    from axonserve.neuron.heap import huge_page_copies

    owners = [m.qweight for m in model.modules() if getattr(m, "qweight", None) is not None]
    skinny = [isinstance(q, PackedWeight) or getattr(q, "skinny", None) is not None for q in owners]
    slots = [(q, "skinny" if s else "data") for q, s in zip(owners, skinny)]
    slots = [(q, name) for q, name in slots if isinstance(getattr(q, name), torch.Tensor)]
    for (q, name), t in zip(slots, huge_page_copies([getattr(q, name) for q, name in slots])):
        setattr(q, name, t)

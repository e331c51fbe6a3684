"""Weight-only quantized linear layers for the native engine (int8, fp8).

A `QuantizedWeight` holds one [out, in] matrix as int8 (or float8 e4m3) data plus float32
scales, one per `group` input columns of each output row: group == in_features is the
per-output-channel layout; group == 32 is GGUF Q8_0's block layout, loaded straight from
the file (exact: the same numbers the float path would dequantize to). `linear(x, w, bias)`
dispatches on the weight's type, so the model calls it wherever it called F.linear.

Kernels, by device (numbers: localrun/bench/weight_quant.py):
- CPU, per-channel int8, a few rows (decode): torch._weight_int8pack_mm (bf16 activations,
  int8 weights read as int8) - the only int8 kernel torch has on CPU that beats fp32 F.linear;
  for more rows it is slower than a dequantize + float matmul, which we then do.
- CUDA int8 and every group-wise weight: dequantize in row chunks inside the matmul
  (int8 -> activation dtype is exact; the per-channel scale is applied to the output).
- FP8 (e4m3, per-channel weight scale, per-token activation scale): torch._scaled_mm on GPUs
  of compute capability >= 8.9 (Ada, Hopper); refused elsewhere.
int4 is not offered: torch's int4 CPU kernel (_weight_int4pack_mm_for_cpu) wants its own
packed layout and group-wise bf16 scales+zeros, and on CUDA it needs tinygemm tiles; neither
pays without a kernel of our own, and Q4 GGUF blocks do not map onto them exactly.

Weights are quantized at load, one source tensor (and at most 4096 rows of it) at a time:
the model never holds a float copy of a quantized matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_DTYPES = ("auto", "int8", "fp8")
Q8_0_GROUP = 32
PACK_MAX_ROWS = 4  # CPU: _weight_int8pack_mm up to this many rows (decode); dequantize + matmul beyond
FP8_MAX = 448.0  # largest float8 e4m3fn value
FP8_MIN_CAPABILITY = (8, 9)


def parse_weight_dtype(name: str | None) -> str:
    """'auto' (the checkpoint's weights in the model dtype, as before), 'int8' or 'fp8'."""
    v = (name or "auto").strip().lower()
    if v not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be auto, int8 or fp8, got {name!r} (auto keeps the model dtype; "
                         "int8 halves bf16 weights, fp8 needs a CUDA GPU of compute capability >= 8.9)")
    return v


def check_supported(kind: str, device: str | torch.device) -> None:
    """Raise ValueError when `kind` cannot run on `device` (fp8 needs Ada/Hopper or newer)."""
    if kind != "fp8":
        return
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError("fp8 weights need a CUDA GPU of compute capability >= 8.9 (Ada, Hopper); "
                         "on this device use weight_dtype int8 (LOCALRUN_WEIGHT_DTYPE=int8)")
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"torch {torch.__version__} lacks float8 matmul (torch._scaled_mm); use weight_dtype int8")
    cap = torch.cuda.get_device_capability(dev)
    if cap < FP8_MIN_CAPABILITY:
        raise ValueError(f"fp8 weights need compute capability >= 8.9 (Ada, Hopper); {torch.cuda.get_device_name(dev)} "
                         f"has {cap[0]}.{cap[1]}; use weight_dtype int8")


def quantize_int8(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of a [rows, cols] float matrix: (int8 [rows, cols], float32 scales
    [rows, cols // group]); group None = one scale per row. |w - q * s| <= s / 2."""
    w = w.float()
    rows, cols = w.shape
    g = cols if group is None else group
    if cols % g:
        raise ValueError(f"{cols} columns do not split into groups of {g}")
    wg = w.reshape(rows, cols // g, g)
    s = wg.abs().amax(-1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: any scale is exact
    q = torch.round(wg / s.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(rows, cols), s


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 of a [rows, cols] matrix with one float32 scale per row ([rows, 1]; amax -> 448)."""
    w = w.float()
    s = w.abs().amax(-1, keepdim=True) / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (w / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rows, cols = q.shape
    g = cols // s.shape[1]
    return (q.float().reshape(rows, -1, g) * s.float().unsqueeze(-1)).reshape(rows, cols).to(dtype)


class QuantizedWeight(nn.Module):
    """An [out_features, in_features] weight stored as int8/fp8 `qweight` + float32 `scale`
    [out_features, in_features // group]. Its buffers are allocated at load, once the group size
    is known (group 32 when every source tensor is GGUF Q8_0, else one scale per output row)."""

    def __init__(self, out_features: int, in_features: int, kind: str, device: torch.device | str):
        super().__init__()
        if kind not in ("int8", "fp8"):
            raise ValueError(f"QuantizedWeight kind must be int8 or fp8, got {kind!r}")
        self.shape = (out_features, in_features)
        self.kind = kind
        self.device_ = torch.device(device)
        self.group = 0  # 0 until allocated
        self.qweight: torch.Tensor | None
        self.scale: torch.Tensor | None
        self.register_buffer("qweight", None)
        self.register_buffer("scale", None)
        self._scale_bf16: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"{self.shape[0]}, {self.shape[1]}, kind={self.kind}, group={self.group}"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale) if t is not None)

    # -- filling -----------------------------------------------------------------------------
    def allocate(self, group: int | None = None) -> None:
        n, k = self.shape
        g = k if group is None else group
        if k % g or (self.kind == "fp8" and g != k):
            raise ValueError(f"cannot store a {self.kind} weight of {k} columns in groups of {g}")
        dt = torch.int8 if self.kind == "int8" else torch.float8_e4m3fn
        self.qweight = torch.empty(n, k, dtype=dt, device=self.device_)
        self.scale = torch.empty(n, k // g, dtype=torch.float32, device=self.device_)
        self.group = g
        self._scale_bf16 = None

    def set_rows(self, start: int, w: torch.Tensor) -> None:
        """Quantize float rows `w` into rows start.. (in slices of 4096 rows)."""
        for i in range(0, w.shape[0], 4096):
            part = w[i:i + 4096].to(self.device_)
            if self.kind == "int8":
                q, s = quantize_int8(part, None if self.group == self.shape[1] else self.group)
            else:
                q, s = quantize_fp8(part)
            self.qweight[start + i:start + i + part.shape[0]].copy_(q)
            self.scale[start + i:start + i + part.shape[0]].copy_(s)

    def load(self, get, parts: list[tuple[str, int]]) -> None:
        """Fill from source tensors stacked by rows (`parts`: (name, rows) in order). When the
        getter can hand out GGUF Q8_0 blocks for every part, they are copied as they are."""
        raw_get = getattr(get, "q8_0", None)
        raws = [raw_get(name) if raw_get and self.kind == "int8" else None for name, _ in parts]
        exact = all(r is not None for r in raws) and self.shape[1] % Q8_0_GROUP == 0
        self.allocate(Q8_0_GROUP if exact else None)
        start = 0
        for (name, n), raw in zip(parts, raws):
            if exact:
                q, s = raw
                if tuple(q.shape) != (n, self.shape[1]):
                    raise ValueError(f"weight {name}: shape {tuple(q.shape)} does not match the config's "
                                     f"{(n, self.shape[1])}")
                self.qweight[start:start + n].copy_(q)
                self.scale[start:start + n].copy_(s)
            else:
                w = get(name)
                if tuple(w.shape) != (n, self.shape[1]):
                    raise ValueError(f"weight {name}: shape {tuple(w.shape)} does not match the config's "
                                     f"{(n, self.shape[1])}")
                self.set_rows(start, w)
            start += n
        if start != self.shape[0]:
            raise ValueError(f"{[p for p, _ in parts]} fill {start} of {self.shape[0]} rows")

    # -- use ---------------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float32, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.shape[0] if stop is None else stop
        return dequantize(self.qweight[start:stop], self.scale[start:stop], dtype)

    def _chunk_rows(self, device_type: str) -> int:
        # CPU: ~256K elements a chunk stay in cache (measured: faster than one big dequantize);
        # CUDA: bound the transient float copy to 64M elements
        budget = 1 << 18 if device_type == "cpu" else 1 << 26
        return max(1, budget // self.shape[1])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if self.kind == "fp8":
            y = _fp8_linear(x2, self.qweight, self.scale)
        elif (self.group == k and x2.device.type == "cpu" and x2.shape[0] <= PACK_MAX_ROWS
              and hasattr(torch, "_weight_int8pack_mm")):
            if self._scale_bf16 is None:
                self._scale_bf16 = self.scale[:, 0].to(torch.bfloat16)
            y = torch._weight_int8pack_mm(x2.to(torch.bfloat16), self.qweight, self._scale_bf16).to(x.dtype)
        else:
            y = self._dequant_matmul(x2)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, self.shape[0])

    def _dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        rows = self._chunk_rows(x.device.type)
        per_channel = self.group == k
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for i in range(0, n, rows):
            j = min(n, i + rows)
            if per_channel:  # int8 -> float is exact; the row scale goes on the output
                out[:, i:j] = F.linear(x, self.qweight[i:j].to(x.dtype)) * self.scale[i:j, 0].to(x.dtype)
            else:
                out[:, i:j].copy_(F.linear(x, self.dequantize(x.dtype, i, j)))
        return out

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized (an embedding lookup)."""
        flat = ids.reshape(-1)
        return dequantize(self.qweight[flat], self.scale[flat], dtype).reshape(*ids.shape, self.shape[1])


def _fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ fp8 weight [N, K]^T with per-row weight scales: activations
    are quantized per token to e4m3 and multiplied on the tensor cores by torch._scaled_mm."""
    m, k = x.shape
    n = w8.shape[0]
    pad = (-m) % 16  # _scaled_mm wants dimensions in multiples of 16
    xf = x.float()
    if pad:
        xf = F.pad(xf, (0, 0, 0, pad))
    sx = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_(min=1e-12)
    x8 = (xf / sx).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if k % 16 or n % 16:
        raise ValueError(f"fp8 weights need dimensions divisible by 16, got [{n}, {k}]; use weight_dtype int8")
    try:  # row-wise scales (per token x per output channel): Hopper and newer
        y = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=w_scale[:, 0].reshape(1, n), out_dtype=out_dtype)
    except RuntimeError:  # Ada: tensor-wise scales only; the per-channel scales go on afterwards
        one = torch.ones((), dtype=torch.float32, device=x.device)
        y = torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = (y * sx * w_scale[:, 0].reshape(1, n)).to(out_dtype)
    return y[:m].to(x.dtype)


# -- what the model calls ------------------------------------------------------------------------
def make_weight(out_features: int, in_features: int, dtype: torch.dtype, kind: str = "auto",
                device: torch.device | str = "meta") -> nn.Parameter | QuantizedWeight:
    """A float parameter (kind auto) or a QuantizedWeight, for the model's constructor."""
    if kind == "auto":
        return nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
    return QuantizedWeight(out_features, in_features, kind, device)


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, QuantizedWeight):
        return w.linear(x, bias)
    return F.linear(x, w, bias)


def embedding(ids: torch.Tensor, w: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, QuantizedWeight):
        return w.embedding(ids, dtype)
    return F.embedding(ids, w)


def named_weights(module: nn.Module) -> list[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Parameters and quantized weights by name, sorted (one order for float and quantized models)."""
    out: list[tuple[str, torch.Tensor | QuantizedWeight]] = list(module.named_parameters())
    out += [(n, m) for n, m in module.named_modules() if isinstance(m, QuantizedWeight)]
    return sorted(out, key=lambda nw: nw[0])


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a model's weights as stored (quantized data and scales included; buffers such
    as the rope table not)."""
    return (sum(p.numel() * p.element_size() for p in module.parameters())
            + sum(m.nbytes for m in module.modules() if isinstance(m, QuantizedWeight)))


def estimate_weight_bytes(cfg, kind: str, elem: int) -> int:
    """Upper bound of a model's stored weight bytes for a memory plan (cfg: a ModelConfig; elem:
    bytes of the model dtype). Quantized matrices cost at most 1 + 4/32 bytes a weight (int8
    with Q8_0's group-32 scales; per-channel and fp8 less); the norms stay in the model dtype."""
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size + cfg.expert_params  # (a mixture's experts: not quantized)
    per_weight = float(elem) if kind == "auto" else 1.0 + 4.0 / Q8_0_GROUP
    return int((cfg.num_params - norms) * per_weight) + norms * elem

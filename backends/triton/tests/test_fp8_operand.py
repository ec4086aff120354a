"""The fp8 -> dot-operand conversions of the decode kernel (`_fp8_operand`, ``KV_CVT``).

Every one of the 256 bytes of e4m3 and e5m2 goes through each conversion the kernels may use
(Triton's interpreter on CPU, or the GPU); the result times its scale factor
(`_kv_scales`: 256 for e4m3 rebuilt from its bits) must equal torch's float32 value of the
byte exactly, NaN bytes excepted (an fp8 cache holds none: writes saturate).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from pagedcore_triton._env import interpreting
from pagedcore_triton.kernels.attention import _fp8_operand

DEVICE = "cpu" if interpreting() else "cuda"


@triton.jit
def _convert_kernel(x_ptr, out_ptr, KV_CVT: tl.constexpr):
    i = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + i, _fp8_operand(x, tl.float16, KV_CVT).to(tl.float32))


# On CPU only the bit rebuild (2) is ours to check: 1 is Triton's own cast (which the
# interpreter gets wrong for e5m2 subnormals; the GPU's cvt is exact), 3 is inline PTX.
CONVERSIONS = [2] if DEVICE == "cpu" else [0, 1, 2, 3]


@pytest.mark.parametrize("cvt", CONVERSIONS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_fp8_byte_converts_exactly(dtype: torch.dtype, cvt: int) -> None:
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x = raw.view(dtype).to(DEVICE)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _convert_kernel[(1,)](x, out, KV_CVT=cvt)
    factor = 256.0 if (cvt == 2 and dtype == torch.float8_e4m3fn) else 1.0  # see _kv_scales
    want = raw.view(dtype).float()
    finite = torch.isfinite(want)
    got = out.cpu() * factor
    assert torch.equal(got[finite], want[finite]), (
        f"cvt {cvt} {dtype}: first mismatch at byte "
        f"{int((got[finite] != want[finite]).nonzero()[0])}"
    )

"""Q3_K: 256 weights in 16 sub-blocks of 16, 3-bit quants, 6-bit sub-block scales."""

from __future__ import annotations

from typing import Any

import numpy as np

from qllama.ggml_types import GGMLType
from qllama.quants.base import Fields, QuantType, Rounding
from qllama.quants.q6_k import GROUP_MAX_EPS, c_absmax, nearest_int_c, seq_sum_rows
from qllama.quants.rounding import F32, fp16, fp16_bytes, read_fp16

_SHIFTS_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)
_SHIFTS_1BIT = np.arange(8, dtype=np.uint8)


def make_q3_quants(xt: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml ``make_q3_quants(n, nmax, x, L, do_rmse=true)`` for many groups at once.

    ``xt`` is ``(n, groups)`` float32, element-major (one group per column). Returns ``L``
    ``(n, groups)`` uint8 in ``[0, 2*nmax)`` (0 for an all-zero group, not nmax) and the
    scales ``(groups,)`` float32.

    After the plain iscale = -nmax/max rounding, ggml re-optimises each element in turn (up
    to 5 passes; weights x**2), accepting a new level when it improves sumlx**2/suml2, and
    stops a group after a pass that changed nothing. The passes stay sequential over the n
    elements because every accepted change moves the running sums the next element sees;
    groups advance in lockstep, and a group that has stopped is masked out.
    """
    xt = np.asarray(xt, dtype=F32)
    n = xt.shape[0]
    mx = c_absmax(xt, axis=0)[0]
    zero = np.abs(mx) < GROUP_MAX_EPS
    iscale = F32(-nmax) / np.where(zero, F32(1), mx)
    lq = np.clip(nearest_int_c(iscale * xt), -nmax, nmax - 1).astype(F32)
    w = xt * xt
    wx = w * xt
    sumlx = seq_sum_rows(wx * lq)  # C: sumlx += w*x[i]*l; suml2 += w*l*l
    suml2 = seq_sum_rows(w * lq * lq)

    # Only the still-active groups are gathered for a pass. Those whose max is positive stop
    # after the first: every w*x*l term has the sign of -max, so slx > 0 never holds.
    active = np.flatnonzero(~zero)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for _ in range(5):
            if active.size == 0:
                break
            x_a, w_a, wx_a, l_a = xt[:, active], w[:, active], wx[:, active], lq[:, active]
            slx_a, sl2_a = sumlx[active], suml2[active]
            changed = np.zeros(active.size, dtype=bool)
            for i in range(n):
                li = l_a[i]
                slx = slx_a - wx_a[i] * li  # the sums without element i
                sl2 = sl2_a - w_a[i] * li * li
                new_l = np.clip(nearest_int_c(x_a[i] * sl2 / slx), -nmax, nmax - 1).astype(F32)
                tried = (slx > 0) & (new_l != li)
                slx = slx + wx_a[i] * new_l
                sl2 = sl2 + w_a[i] * new_l * new_l
                take = tried & (sl2 > 0) & (slx * slx * sl2_a > slx_a * slx_a * sl2)
                l_a[i] = np.where(take, new_l, li)
                slx_a = np.where(take, slx, slx_a)
                sl2_a = np.where(take, sl2, sl2_a)
                changed |= take
            lq[:, active], sumlx[active], suml2[active] = l_a, slx_a, sl2_a
            active = active[changed]
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    lq = np.where(zero, 0, lq + nmax).astype(np.uint8)
    return lq, np.where(zero, F32(0), scale).astype(F32)


class Q3_K(QuantType, ggml_type=GGMLType.Q3_K, vec_dot_type="Q8_K"):
    """Super-block of 256 weights (16 sub-blocks of 16), 110 bytes::

        offset 0            32             96            108    110
              +------------+--------------+-------------+------+
              | hmask[32]  | qs[64]       | scales[12]  | d    |
              | high bits  | low 2 bits   | 16 x 6 bits | fp16 |
              +------------+--------------+-------------+------+

    q[e] is a 3-bit value, e = 128n + 32j + l (half n in 0..1, j in 0..3, l in 0..31)::

                       bits 7..6          5..4               3..2               1..0
        qs[32n + l]    q[128n + 96 + l]   q[128n + 64 + l]   q[128n + 32 + l]   q[128n + l]

                       bit 7        6            ...   1           0
        hmask[l]       q[224 + l]   q[192 + l]   ...   q[32 + l]   q[l]       (bit 2 of q)

    Sub-block scale s[i], i = e // 16, 6 bits (b = 0..3 in each row)::

                       bits 7..6       5..4           3..2           1..0
        scales[b]      s[b + 8] bits 3..0             s[b] bits 3..0
        scales[4 + b]  s[b + 12] bits 3..0            s[b + 4] bits 3..0
        scales[8 + b]  s[b + 12] 5..4  s[b + 8] 5..4  s[b + 4] 5..4  s[b] 5..4

    value[e] = (d * (s[e // 16] - 32)) * (q[e] - 4).
    """

    @classmethod
    def unpack(cls, blocks: np.ndarray) -> Fields:
        return {
            "hmask": blocks[:, :32],
            "qs": blocks[:, 32:96],
            "scales": blocks[:, 96:108],
            "d": read_fp16(blocks[:, 108:110]),
        }

    @classmethod
    def dequantize_fields(cls, fields: Fields, *, xp: Any) -> Any:
        s = fields["scales"]
        nb = s.shape[0]
        lo = xp.concat([s[:, :8] & 15, s[:, :8] >> 4], axis=1)
        top = s[:, 8:]
        hi = xp.concat([(top >> k) & 3 for k in (0, 2, 4, 6)], axis=1)
        # widen before subtracting: both the scale and q are stored offset, unsigned
        sc = xp.astype(lo | (hi << 4), xp.float32) - 32.0
        dl = fields["d"] * sc  # C: dl = d_all * (sc - 32), then dl * q
        qs = xp.reshape(fields["qs"], (nb, 2, 1, 32))
        low = xp.reshape(xp.concat([(qs >> k) & 3 for k in (0, 2, 4, 6)], axis=2), (nb, 256))
        hm = xp.reshape(fields["hmask"], (nb, 1, 32))
        high = xp.reshape(xp.concat([(hm >> b) & 1 for b in range(8)], axis=1), (nb, 256))
        q = xp.astype(low | (high << 2), xp.float32) - 4.0
        y = xp.reshape(dl, (nb, 16, 1)) * xp.reshape(q, (nb, 16, 16))
        return xp.reshape(y, (nb, 256))

    @classmethod
    def quantize_blocks(cls, x: np.ndarray, *, rounding: Rounding = "ref") -> np.ndarray:
        """quantize_row_q3_K_ref, all blocks at once."""
        cls._check_rounding(rounding)
        # C overflows silently: huge inputs give an inf fp16 d, then inf/NaN steps ggml takes too
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return cls._quantize(np.asarray(x, dtype=F32))

    @classmethod
    def _quantize(cls, x: np.ndarray) -> np.ndarray:
        nb = x.shape[0]
        xs = x.reshape(nb, 16, 16)
        lq, scales = make_q3_quants(np.ascontiguousarray(xs.reshape(-1, 16).T), 4)
        lq = lq.T.reshape(nb, 16, 16)
        scales = scales.reshape(nb, 16)

        # ggml tests max_scale != 0 here (no epsilon); a zero one leaves the scale bytes 0
        max_scale = c_absmax(scales, axis=1)
        has = max_scale != 0
        iscale = F32(-32) / np.where(has, max_scale, F32(1))
        ls = np.where(has, np.clip(nearest_int_c(iscale * scales), -32, 31) + 32, 0)
        d_raw = np.where(has, F32(1) / iscale, F32(0))
        # requantize against the stored scales; a zero dd keeps make_q3_quants' L (stale)
        dd = fp16(d_raw) * (ls - 32).astype(F32)
        skip = dd == 0
        lr = nearest_int_c(xs / np.where(skip, F32(1), dd)[..., None])
        lq = np.where(skip[..., None], lq, np.clip(lr, -4, 3) + 4).astype(np.uint8)

        ls = ls.astype(np.uint8)
        lq = lq.reshape(nb, 256)
        out = np.empty((nb, cls.type_size), dtype=np.uint8)
        high = (lq >> 2).reshape(nb, 8, 32) << _SHIFTS_1BIT[:, None]
        out[:, :32] = np.bitwise_or.reduce(high, axis=1)
        low = (lq & 3).reshape(nb, 2, 4, 32) << _SHIFTS_2BIT[:, None]
        out[:, 32:96] = np.bitwise_or.reduce(low, axis=2).reshape(nb, 64)
        out[:, 96:104] = (ls[:, :8] & 15) | ((ls[:, 8:] & 15) << 4)
        top = (ls >> 4).reshape(nb, 4, 4) << _SHIFTS_2BIT[:, None]
        out[:, 104:108] = np.bitwise_or.reduce(top, axis=1)
        out[:, 108:] = fp16_bytes(d_raw)
        return out

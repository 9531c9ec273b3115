"""Q3_K and Q6_K edge cases that tests/test_quants.py does not reach.

The byte digests are sha256 of what ggml itself wrote (``ggml_quantize_chunk``, no imatrix,
libggml-base of llama-cpp-python 0.3.36 on x86-64) for the inputs built here. The inputs are
exact binary fractions, so no libm call can make them differ between machines.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qllama import quants
from qllama.array_api import to_numpy
from qllama.quants.kquant_search import make_q3_quants, make_qx_quants

F32 = np.float32
IDX = np.arange(512)
TYPES = ["Q3_K", "Q6_K"]


def _pattern() -> np.ndarray:
    """512 pseudo-random multiples of 1/128 in [-1, 1)."""
    return ((IDX * 7919 + 13) % 257 - 128) / 128.0


def _stale() -> np.ndarray:
    # sub-blocks 0 and 21 are 1e4-1e5 times smaller than the rest: their scale codes round
    # to 0 and ggml leaves their search levels in the bytes (pitfall 13)
    x = _pattern()
    x[:16] *= 1e-4
    x[336:352] *= 1e-5
    return x


def _outlier(sign: int) -> np.ndarray:
    # one dominant element per super-block (sub-block 2 of each)
    x = 0.1 * _pattern()
    x[37], x[300] = 3.0 * sign, 2.0 * sign
    return x


def _one_per_sub_block() -> np.ndarray:
    x = np.zeros(512)
    at = IDX[::16]
    x[at + (at // 16) % 16] = ((at // 16) % 7 - 3.5) / 2
    return x


CASES: dict[str, Callable[[], np.ndarray]] = {
    "zeros": lambda: np.zeros(512),
    "below_eps": lambda: np.where(IDX % 2 == 1, 9e-16, -9e-16),
    "stale_sub_block": _stale,
    "max_positive": lambda: _outlier(1),
    "max_negative": lambda: _outlier(-1),
    "fp16_d_underflows": lambda: _pattern() * 1e-9,
    "fp16_d_overflows": lambda: _pattern() * 1e9,  # d = inf, then inf*0 = NaN steps
    "ties": lambda: ((IDX * 5) % 16 - 8) * 0.25,
    "one_per_sub_block": _one_per_sub_block,
}

GGML_SHA256 = {
    ("zeros", "Q3_K"): "ac9ab7fef49ac432f1e4b9b43d3df89c",
    ("zeros", "Q6_K"): "de1da8f3791deb5ea5a11c9a67179b1e",
    ("below_eps", "Q3_K"): "ac9ab7fef49ac432f1e4b9b43d3df89c",
    ("below_eps", "Q6_K"): "de1da8f3791deb5ea5a11c9a67179b1e",
    ("stale_sub_block", "Q3_K"): "07c0da3b4c87f81a12287c5be0988d7b",
    ("stale_sub_block", "Q6_K"): "a0b427bcc15c4b9f12465679e6d6ab46",
    ("max_positive", "Q3_K"): "af5963ce69cd23478d775b5f9b94f0d2",
    ("max_positive", "Q6_K"): "3753b10f749f4ffeba8a626cd56d9eae",
    ("max_negative", "Q3_K"): "d978b728d31285ff2f0e732bbf200124",
    ("max_negative", "Q6_K"): "78ed4bcd7ac7f7828f2606f21f69e0af",
    ("fp16_d_underflows", "Q3_K"): "b731018edb431143fa53397d42fc5655",
    ("fp16_d_underflows", "Q6_K"): "2471dec5be2d943d2c479a4eca9fca2e",
    ("fp16_d_overflows", "Q3_K"): "520dd70936715ef407862235de8d30eb",
    ("fp16_d_overflows", "Q6_K"): "5bb89ff196f3d02dedbcb5adea8f0747",
    ("ties", "Q3_K"): "87e77a112540270ad212e198bcd70b80",
    ("ties", "Q6_K"): "5589c79ca52fc3c4bbb824b29d328b5d",
    ("one_per_sub_block", "Q3_K"): "4720b25a6c59b5234b8c5ce6ea4ee735",
    ("one_per_sub_block", "Q6_K"): "9cf2ac3d22c56e25850b7a973ef5b656",
}


def _x(name: str) -> np.ndarray:
    return CASES[name]().astype(F32)


@pytest.mark.parametrize(("name", "qtype"), list(GGML_SHA256))
def test_edge_cases_give_ggmls_bytes(name, qtype):
    raw = quants.quantize(_x(name), qtype)
    assert hashlib.sha256(raw.tobytes()).hexdigest()[:32] == GGML_SHA256[name, qtype]


# --- reading the bytes back independently of dequantize ---------------------------------


def _scale_codes(qtype: str, raw: np.ndarray) -> np.ndarray:
    """Signed sub-block scale multipliers ``(n_blocks, 16)``, decoded per the docstrings."""
    cls = quants.get(qtype)
    f = cls.unpack(raw.reshape(-1, cls.type_size))
    if qtype == "Q6_K":
        return f["scales"].astype(np.int32)
    s = f["scales"].astype(np.int32)
    codes = np.empty((s.shape[0], 16), np.int32)
    for i in range(16):
        low = s[:, i] & 15 if i < 8 else s[:, i - 8] >> 4
        codes[:, i] = (low | ((s[:, 8 + i % 4] >> (2 * (i // 4))) & 3) << 4) - 32
    return codes


def _levels(qtype: str, raw: np.ndarray) -> np.ndarray:
    """The stored quant levels ``(n_blocks, 256)``: dequantize with d = 1 and unit scales."""
    cls = quants.get(qtype)
    f = cls.unpack(raw.reshape(-1, cls.type_size))
    f["d"] = np.ones_like(f["d"])
    if qtype == "Q6_K":
        f["scales"] = np.ones_like(f["scales"])  # value = q - 32
        mid = 32
    else:
        # every 6-bit scale 33 (low nibble 1, top bits 2), so value = q - 4
        f["scales"] = np.tile(np.array([0x11] * 8 + [0xAA] * 4, np.uint8), (raw.size // 110, 1))
        mid = 4
    return cls.dequantize_fields(f, xp=np).astype(np.int32) + mid


def _search(qtype: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The type's sub-block search on groups ``(g, 16)``: levels ``(g, 16)`` and scales."""
    levels, scales = make_qx_quants(x.T, 32) if qtype == "Q6_K" else make_q3_quants(x.T, 4)
    return levels.T, scales


@pytest.mark.parametrize("qtype", TYPES)
def test_zero_scale_sub_block_keeps_the_search_levels(qtype):
    x = _x("stale_sub_block")
    raw = quants.quantize(x, qtype)
    codes = _scale_codes(qtype, raw).reshape(-1)
    stale = [0, 21]
    assert (codes[stale] == 0).all() and (np.delete(codes, stale) != 0).all()
    levels = _levels(qtype, raw).reshape(32, 16)
    searched, _ = _search(qtype, x.reshape(32, 16)[stale])
    np.testing.assert_array_equal(levels[stale], searched)
    assert len(np.unique(levels[stale])) > 2  # not a requantized constant
    y = quants.dequantize(raw, qtype, x.shape).reshape(32, 16)
    assert not y[stale].any()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("sign", [1, -1])
def test_largest_scale_takes_the_most_negative_code(qtype, sign):
    x = _x("max_positive") * sign
    raw = quants.quantize(x, qtype).reshape(2, -1)
    codes = _scale_codes(qtype, raw)
    extreme = -128 if qtype == "Q6_K" else -32
    assert (codes[:, 2] == extreme).all() and (codes[:, np.r_[0:2, 3:16]] > extreme).all()
    # scale = sumlx/suml2 has the sign of -max, so d = -max_scale/|extreme| has max's sign
    d = quants.get(qtype).unpack(raw)["d"][:, 0]
    assert (np.sign(d) == sign).all()
    y = quants.dequantize(raw, qtype, (2, 256))
    np.testing.assert_allclose(y[[0, 1], [37, 44]], x[[37, 300]], rtol=2e-3)


@settings(max_examples=30, deadline=None)
@given(
    qtype=st.sampled_from(TYPES),
    x=hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 3), st.just(256)),
        elements=st.floats(-float(F32(9e-16)), float(F32(9e-16)), width=32),
    ),
)
def test_blocks_below_group_max_eps_are_all_zero_bytes(qtype, x):
    assert not quants.quantize(x, qtype).any()


def _blocks(seed: int, n: int) -> np.ndarray:
    """``n`` blocks, each a different kind (scale, tails, ties, zeros, stale sub-blocks)."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in rng.integers(0, 6, n):
        scale = 10.0 ** rng.uniform(-12, 8)
        v = [
            rng.standard_normal(256),
            rng.standard_t(2, 256),
            rng.integers(-16, 16, 256) / 4,
            np.where(rng.random(256) < 0.9, 0, rng.standard_normal(256)),
            rng.standard_normal(256) * np.repeat(10.0 ** rng.uniform(-6, 0, 16), 16),
            np.zeros(256),
        ][kind]
        out.append(v * scale)
    return np.asarray(out, dtype=F32)


@settings(max_examples=25, deadline=None)
@given(qtype=st.sampled_from(TYPES), seed=st.integers(0, 2**32 - 1))
def test_blocks_are_quantized_independently(qtype, seed):
    # the vectorised searches run all sub-blocks in lockstep with per-group masks
    x = _blocks(seed, 12)
    together = quants.quantize(x, qtype)
    alone = np.concatenate([quants.quantize(row, qtype) for row in x])
    np.testing.assert_array_equal(together, alone)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_q6_k_of_negated_input_only_flips_the_sign_of_d(seed):
    # the search, the -128 code and the requantization are all symmetric under x -> -x
    x = _blocks(seed, 8)
    pos, neg = quants.quantize(x, "Q6_K"), quants.quantize(-x, "Q6_K")
    pos[pos.any(axis=1), 209] ^= 0x80  # all-zero blocks have no d to flip
    np.testing.assert_array_equal(pos, neg)


# --- the searches against a one-group-at-a-time transcription of ggml's C loops -----------

EPS = F32(1e-15)


def _nearest(f: np.float32) -> int:
    v = np.array([f + F32(12582912.0)], dtype=F32).view(np.int32)[0]
    return int(v & 0x7FFFFF) - 0x400000


def _absmax(x: np.ndarray) -> tuple[np.float32, np.float32]:
    amax, mx = F32(0), F32(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    return mx, amax


def _clamp(v: int, nmax: int) -> int:
    return max(-nmax, min(nmax - 1, v))


def _scalar_make_qx(x: np.ndarray, nmax: int) -> tuple[list[int], np.float32]:
    mx, amax = _absmax(x)
    if amax < EPS:
        return [0] * len(x), F32(0)

    def fit(iscale: np.float32) -> tuple[list[int], np.float32, np.float32]:
        ls, sumlx, suml2 = [], F32(0), F32(0)
        for v in x:
            ls.append(_clamp(_nearest(iscale * v), nmax))
            w = v * v
            sumlx += w * v * F32(ls[-1])
            suml2 += w * F32(ls[-1]) * F32(ls[-1])
        return ls, sumlx, suml2

    lq, sumlx, suml2 = fit(F32(-nmax) / mx)
    scale = sumlx / suml2 if suml2 else F32(0)
    best = scale * sumlx
    for step in [*range(-9, 0), *range(1, 10)]:
        ls, sumlx, suml2 = fit(-(F32(nmax) + F32(0.1) * F32(step)) / mx)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            lq, scale = ls, sumlx / suml2
            best = scale * sumlx
    return [v + nmax for v in lq], scale


def _scalar_make_q3(x: np.ndarray, nmax: int) -> tuple[list[int], np.float32]:
    mx, amax = _absmax(x)
    if amax < EPS:
        return [0] * len(x), F32(0)
    iscale = F32(-nmax) / mx
    lq, sumlx, suml2 = [], F32(0), F32(0)
    for v in x:
        lq.append(_clamp(_nearest(iscale * v), nmax))
        w = v * v
        sumlx += w * v * F32(lq[-1])
        suml2 += w * F32(lq[-1]) * F32(lq[-1])
    for _ in range(5):
        n_changed = 0
        for i, v in enumerate(x):
            w = v * v
            slx = sumlx - w * v * F32(lq[i])
            if slx > 0:
                sl2 = suml2 - w * F32(lq[i]) * F32(lq[i])
                new_l = _clamp(_nearest(v * sl2 / slx), nmax)
                if new_l != lq[i]:
                    slx += w * v * F32(new_l)
                    sl2 += w * F32(new_l) * F32(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        lq[i], sumlx, suml2 = new_l, slx, sl2
                        n_changed += 1
        if not n_changed:
            break
    return [v + nmax for v in lq], sumlx / suml2 if suml2 > 0 else F32(0)


_groups = st.builds(
    lambda a, scale: (a * F32(scale)).astype(F32),
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 6), st.just(16)),
        # quarter-integers make exact rounding ties
        elements=st.one_of(st.floats(-1, 1, width=32), st.integers(-8, 8).map(lambda k: k / 4)),
    ),
    st.sampled_from([1e-14, 1e-6, 1.0, 1e5]),
)


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(TYPES), x=_groups)
def test_vectorised_search_equals_ggmls_sequential_loop(qtype, x):
    scalar = _scalar_make_qx if qtype == "Q6_K" else _scalar_make_q3
    nmax = 32 if qtype == "Q6_K" else 4
    with np.errstate(all="ignore"):
        levels, scales = _search(qtype, x)
        want = [scalar(g, nmax) for g in x]
    np.testing.assert_array_equal(levels, np.array([w[0] for w in want]))
    np.testing.assert_array_equal(
        scales.view(np.uint32), np.array([w[1] for w in want], F32).view(np.uint32)
    )


@settings(max_examples=40, deadline=None)
@given(x=_groups)
def test_make_q3_quants_refines_only_groups_whose_max_is_negative(x):
    # With iscale = -4/max every term w*x*l has the sign of -max, so for max > 0 ggml's
    # "slx > 0" never holds: those groups keep plain rounding (a ggml quirk, kept here).
    levels, _ = _search("Q3_K", x)
    mx = np.array([_absmax(g)[0] for g in x])
    pos = mx >= EPS
    with np.errstate(divide="ignore"):
        plain = np.clip(np.rint(F32(-4) / mx[pos, None] * x[pos]), -4, 3) + 4
    np.testing.assert_array_equal(levels[pos], plain)


def test_make_q3_quants_refinement_changes_some_negative_groups():
    x = -np.abs(np.random.default_rng(0).standard_normal((200, 16))).astype(F32)
    levels, _ = _search("Q3_K", x)
    plain = np.clip(np.rint(F32(-4) / x.min(axis=1, keepdims=True) * x), -4, 3) + 4
    assert (levels != plain).any(axis=1).sum() > 10


@pytest.mark.parametrize("qtype", TYPES)
def test_edge_cases_dequantize_identically_in_every_namespace(qtype, xp):
    for name in CASES:
        raw = quants.quantize(_x(name), qtype)
        with np.errstate(all="ignore"):  # fp16_d_overflows: inf * 0
            want = quants.dequantize(raw, qtype, (512,))
            got = to_numpy(quants.dequantize(raw, qtype, (512,), xp=xp))
        # inf*0 NaNs (fp16_d_overflows) may differ in sign bit between libraries
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan, err_msg=name)
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32), name)

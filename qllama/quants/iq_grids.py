"""The lattice grids of ggml's IQ formats, and every table ggml's code derives from them.

An IQ format stores a group of 8 values (IQ2_*, IQ1_*) or 4 values (IQ3_*) as the index of
a point of a fixed grid, plus signs and scales. Each grid is a set of points of a small
lattice: 8 coordinates of 3 levels (3**8 = 6561 points) or 4 coordinates of 8 levels
(8**4 = 4096 points). ggml lists each grid twice, as the bytes its dequantizers read
(``ggml-common.h``, ``iq2xxs_grid``...) and as packed level indices for its quantizers
(``ggml-quants.c``, ``kgrid_*``); both lists hold the same points in the same order, the
increasing order of ``sum(level[j] * levels**j)`` (coordinate 0 least significant).

So a grid is exactly its membership mask over the lattice in that order, and that is the
one copy kept here: bit ``t`` of the mask (byte ``t // 8``, bit ``t % 8``) is set when
lattice point ``t`` is on the grid, and a point's grid index is the number of set bits
before it. Each ``_MASK`` below is that bitmask (821 bytes for 3**8 points, 512 for 8**4),
zlib-compressed and base64-encoded. Everything else is derived:

* ``values``: the byte each level dequantizes to (the coordinates of ``ggml-common.h``'s
  grids), ``table``: each grid point's values;
* ``kmap``: the quantizer's map from a packed level index ``u`` (2 bits a coordinate for 3
  levels, 3 bits for 8; ggml's ``kmap_q2xs`` / ``kmap_q3xs``) to a grid index, -1 off the grid;
* the neighbour lists of every off-grid ``u`` the quantizers can produce
  (``iq2xs_init_impl`` / ``iq3xs_init_impl``): the grid points sorted by squared distance and
  then index, keeping those within the ``nwant`` smallest distinct distances;
* the sign bytes: ggml's ``ksigns_iq2xs[i]`` is ``i`` with bit 7 set to the parity of its
  7 bits, so that every group has an even number of negative values (:func:`parity_signs`).
"""

from __future__ import annotations

import base64
import importlib.util
import zlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import array_api_compat
import numpy as np

from qllama.errors import WeightValueError

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)

_IQ2XXS_MASK = (
    "eNp1UkuqxDAMk8Hdq5B3Hwd6gG7m/ld5tvPt0BENpLHkSG4/f+XDq1ZouUAAaigwxA64afWEFLXbz718+LoBQVCq"
    "n5eSxPakiugoSjpNT6j4xkLlkEakmrdsKvaVVzQcEqXwcY6jlFtvHa9ytE5NdA8erHrVBlu7ptfiaQ4UTzR7t0+D"
    "9Mhgk18I792/MWkMozOpYEUGZTWnjKHk4pUeVVKiD+3yaLJ11MlR6vJsezlRkya9ZIuWJs+Vsrxm3zJ8I6bZP4Xa"
    "FM4G+dvYCpk35szlEWu/YcUTjjHsvjFmaK+qB/ijNp18T/Nl/wr9TfsHxl0VIw=="
)
_IQ2XS_MASK = (
    "eNpdUVuuhTAIHBL6j4nuhyb2vyZ2/1s5PFr13uYcxQLDzDDGuEarR6N7jN6qFMJ9iVYGEbqnDtoZlkIhZkArpNjL"
    "fqNsO5NA1bo8JYAFBDtigJd16QK0VEffvNELHLCRJGDcOCavsBSwVdr3Ft8MzBI/YyQguItPFR+YrVZ4Vig91ZxJ"
    "msCQSjFFFqbnQF6FMyWHrikZp8mrtADNKEt5SwnyPsOM0miHp4hoTq0xX7HOtDckM8rDMHs17BW3p+aFYCbtz+aG"
    "BpShy2TzehJuiNPq30xqNOkvCWeIZyg+If0x2t8iIbnQwY7bDyOfokOFu1z32/oVuavEmHEw5Vjp7gI+vAKcOd2I"
    "zVCwoLfAQE4LqnxJ7h+iL1v+XMoqbTQn0uOl7msKr70o/h/N4W2uYLIu79Po/gBOsClJ"
)
_IQ2S_MASK = (
    "eNptUl2KBiEMa0HfK+h9KozvCvb+V9m0OrvfsivD/MXEJGpmy4a1XPAyh9Xc6l4yLVEpeAwza3usaVZxAVJAq6Yp"
    "pM2cJcyaLT2AlIirZCEipW1rQbmtui2WsEqz9p4y1US+1ivoUAjWzIBAV1vJISY6EP4lcShBm/Zqq+fEhfbsmg9L"
    "aCXMz/QgxS/BAkpmUINcYMOXIGrxTSGOT9yYpnu1Vh9vI1+HvSWP7L7MthfV6UCzvw4hIPVAsBEstKF0IB8QbMGi"
    "P5Er4HetD0G65iMyICUE/BGMWiLJM1qGQ/VNuR2K20hOIF6fghIY3ex4n3JL4FPLO2KGahul7iKdaRzznbS0y8Iu"
    "F4+cfyKzQ/OKg5U5ZHDnVx3K2c/KMLms2JRQPAfAKf90WOQ7NiDh02sg9DEwGad3h46fCTlhJKkX/TCtK8h6O/yV"
    "Gdg1ylcNv5Ur35q+ALm8Vh4="
)
_IQ1S_MASK = (
    "eNotUkFLnEcYfneq4XVMZWM/QXJ696ux01kR6y3pZZFdWPRiQvIHPNm0SMk5TT4nu+mX2RRCILQ0l3EwyTgNq/FQ"
    "tp+wAU9WemjprQdpPYS6HgJeGgzEzK69zbzwvM/zvM9z7UJUN2zmMlY+c3dJ2/MoKarPR4rKlQsj/YYpSkcBlflA"
    "mnTL8wd+EGLg/r4yWAqoQprMRwGup/AHg4kMk6hO1ZlrWMlNbBvS4yDHnLe4v44oBAQu4QW5hPhj/CVztNu8Z5v+"
    "0s3DTralhlpxtvvn0EMWQ0xOZ1wxBDn7t/08pqKF5dKy1wLjXFA4omigUrhaN8g+dpeopuhqkGEJH81HTGLLqcRU"
    "GaGyi5aJnyTWw3sKKyXoKjQwcxkquU8VaCVxZSrqD5bFqXjGyEug4Re6KVy24t3XoDgyEbMaKKgmprMh/TY1srjz"
    "17NGY8k9DP8bDV0+K6laKwkt0dPObza26z+afx0DBtKlQIlpWCsyk6hpnrVb2btDa4oWNRcdCyvT7OzxamfvddFN"
    "fte+dXj83+2Xr77J9r54+8nJy/Hj4YN/dJz37aGax003qJon2djBnaRvYWLxyPHVIgTLuO+HgSnJn9Kv6t4DJcDC"
    "/eQjUIjwlfZ+iz1ta7PLki+/n/x98yCv8pN+T4z88aQPePcOhLkVUv5iFk/XzEAyCtousOWoHA5VeK56KXsS/ls+"
    "3Eu532C3NjlipmRjSAEtXtdLLe8TIK72d+IClruoAU0joVF3OXopE+BdVMFBb+E+pYqPhgi89XqjwbgMFCrxXKCA"
    "tZTFpj0oWqizuc1gefVN09MVsfizmXqVcBaacH0hFIl5X/Qdu2YsYp6MjkENnabMexVdOwOznuETyH9Y/j/l/lBp"
    "9fyIACBw8Yw6loGqDoiDCM7NVbrdcKynMB3DVPAShkmwzLoLc+8B4wUZaQ=="
)
_IQ3XXS_MASK = (
    "eNpNUTEOwjAMPFuxVGUKQ/eKCfGKdGCHH0WdEK9g5Jn4nKZwVdUmPt+dk/llmoBLtrNpgcxqL2xYNlvgEExopeGy"
    "AckfwgsFeMBLimx5bgKYWhSzqa+QDKIVFeeu4jj5ChqqgRTblm/0xzX6nmKbNXGSntCb6DfRq7kbjTtyjSBQy66/"
    "hN+d+2xmUmVXQJrvrAzPhsIYUZoYzGd743mEKqQLVncbdJqUEUMGcbH932U9l6yoo4HjpLQ7QEI8ddpIhIPI7z1c"
    "tL8Nw3X9CxXSe8Mevst9ZNxL7bIcM/FIRlwNpv2O7piB+AIWuhT2"
)
_IQ3S_MASK = (
    "eNotUcFKw0AQfTPMwmZPuyHiNd1GqPmKrdSDeimC+DtpqdD2luIHiFYE+5PObpzDwLw3897b5Od1br+dOV3PD9Ej"
    "ytdDDGeHykbz6M0QaV9LxaAG9/YTySYHhoCvdEYAri/mGWuWp8AVGyzpHKRqSU7VNugiLRq4le4VlqE1Yq3dGW4z"
    "f3k5mt4Mt+bQ1aL8CW7De9Q33DihhC2qTuHOswxkQW9ZRC9bTmQJkF/p39ly7x0ItCLRqIpzONKxhbV3qioBbFrx"
    "CRYJJYaDaXOaIKOwHu6czGxUfMaWBiHvTMy8gR+y3Ee5EqiCRzaYgaxCEgSjJN8LS14gtkvdwY4GeG5tDZKUhXJ3"
    "KJUXm9K1+oxqAGx08Jn00gqR5+yipY9QsMLkm0MX/F9rhEnkBcIeC53rpb6Gi0eXc8T8kWhylcm7/IVJG/gDusYn"
    "IA=="
)

# Whether Grid.nearest may use its compiled twin (qllama/quants/iq_search_jit.py): None asks
# whether numba is installed; tests set False to run the numpy path, its oracle.
USE_COMPILED: bool | None = None


def compiled() -> bool:
    """Whether the neighbour search runs compiled (numba installed, not switched off)."""
    if USE_COMPILED is None:
        return importlib.util.find_spec("numba") is not None
    return USE_COMPILED


@dataclass(frozen=True, eq=False)
class Grid:
    """One IQ grid: its points, what they dequantize to, and the quantizer's lookup tables."""

    name: str
    dims: int  # coordinates of a point: the values of one group
    levels: int  # levels of a coordinate
    values: tuple[int, ...]  # what each level dequantizes to (ggml-common.h's bytes)
    nwant: int  # neighbour lists keep the points at the nwant smallest distances
    mask: str  # the grid's lattice bitmask, zlib + base64

    @property
    def bits(self) -> int:
        """Bits of one coordinate in the quantizer's packed index ``u``."""
        return (self.levels - 1).bit_length()

    @cached_property
    def points(self) -> np.ndarray:
        """``(n, dims)`` uint8: the level of each coordinate of each grid point, in order."""
        bitmask = np.frombuffer(zlib.decompress(base64.b64decode(self.mask)), np.uint8)
        on = np.flatnonzero(np.unpackbits(bitmask, bitorder="little")[: self.levels**self.dims])
        digits = on[:, None] // self.levels ** np.arange(self.dims) % self.levels
        return digits.astype(np.uint8)

    @cached_property
    def table(self) -> np.ndarray:
        """``(n, dims)`` float32: each grid point's values, as ggml's dequantizers read them."""
        return np.asarray(self.values, dtype=F32)[self.points]

    @cached_property
    def ints(self) -> np.ndarray:
        """``(n, dims)`` int8: the same values as integers, as ggml's dot products read them."""
        return np.asarray(self.values, dtype=np.int8)[self.points]

    def pack(self, levels: np.ndarray, axis: int = -1) -> np.ndarray:
        """Levels along ``axis`` (``dims`` of them) -> the packed index ``u`` (int64)."""
        shifts = self.bits * np.arange(self.dims)
        lv = np.moveaxis(np.asarray(levels, dtype=np.int64), axis, -1)
        return np.bitwise_or.reduce(lv << shifts, axis=-1)

    @cached_property
    def kmap(self) -> np.ndarray:
        """``(2**(bits*dims),)`` int32: grid index of each packed index ``u``, -1 off the grid."""
        kmap = np.full(1 << (self.bits * self.dims), -1, dtype=np.int32)
        kmap[self.pack(self.points)] = np.arange(len(self.points), dtype=np.int32)
        return kmap

    @cached_property
    def _neighbours(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per packed index: (start, count) into a flat list of grid indices (count 0 on the
        grid). Lists are made for every lattice point whose levels a quantizer can produce."""
        lattice = (
            np.arange(self.levels**self.dims)[:, None]
            // self.levels ** np.arange(self.dims)
            % self.levels
        )  # (levels**dims, dims): every point, digits of its lattice number
        u = self.pack(lattice)
        off = lattice[self.kmap[u] < 0].astype(np.int32)
        pts = self.points.astype(np.int32)
        n_grid = len(pts)
        # squared distances in ggml's coordinates 2l + 1 (four times those between levels),
        # as sort keys d2 * n_grid + index: sorting them sorts by distance, then index
        key = np.zeros((len(off), n_grid), dtype=np.int32)
        for i in range(self.dims):
            diff = 2 * (off[:, i, None] - pts[None, :, i])
            key += diff * diff
        key = np.sort(key * n_grid + np.arange(n_grid, dtype=np.int32), axis=1)
        order, ranked = key % n_grid, key // n_grid
        distinct = np.cumsum(np.diff(ranked, axis=1, prepend=-1) > 0, axis=1)  # 1, 1, 2, ...
        keep = distinct <= self.nwant
        count = keep.sum(axis=1)
        start = np.zeros(len(self.kmap), dtype=np.int64)
        counts = np.zeros(len(self.kmap), dtype=np.int64)
        off_u = self.pack(off)
        counts[off_u] = count
        start[off_u] = np.cumsum(count) - count
        flat = order[keep].astype(np.int32)  # row by row: each point's list in order
        return start, counts, flat

    def neighbour_list(self, u: int) -> np.ndarray:
        """The grid indices ggml's quantizer tries, in order, for the off-grid index ``u``."""
        start, count, flat = self._neighbours
        return flat[start[u] : start[u] + count[u]]

    def nearest(
        self,
        u: np.ndarray,
        x: np.ndarray,
        w: np.ndarray,
        scale: np.ndarray,
        level_values: np.ndarray,
        which: np.ndarray | None = None,
    ) -> np.ndarray:
        """ggml's ``iq2_find_best_neighbour`` / ``iq3_find_best_neighbour`` /
        ``iq1_find_best_neighbour2`` for ``m`` off-grid groups at once.

        ``u`` ``(m,)`` off-grid packed indices; ``x``, ``w`` ``(m, dims)`` float32, the values
        to fit and their weights; ``scale`` ``(m,)``; ``level_values`` ``(v, levels)``: the
        value of each level in the fit, in ``v`` variants, ``which`` ``(m,)`` picking each
        group's (variant 0 if None). Over each group's neighbour list, in order,
        ``d2 = sum_i (w_i * diff_i) * diff_i`` with ``diff = scale*q - x`` (float32, from 0,
        in coordinate order); the first smallest ``d2`` wins, as ggml's strict ``<``.
        Returns the winning grid indices ``(m,)`` int32. Runs compiled where numba is
        installed (:func:`compiled`), with the same result.
        """
        start, count, flat = self._neighbours
        table = np.ascontiguousarray(np.asarray(level_values, dtype=F32)[:, self.points.T])
        if compiled():
            from qllama.quants import iq_search_jit

            pick = np.zeros(len(u), np.int64) if which is None else which.astype(np.int64)
            found: np.ndarray = iq_search_jit.nearest(
                start,
                count,
                flat,
                table,
                pick,
                u.astype(np.int64),
                np.ascontiguousarray(x, dtype=F32),
                np.ascontiguousarray(w, dtype=F32),
                np.ascontiguousarray(scale, dtype=F32),
            )
            _check_found(found >= 0)
            return found
        n = count[u]
        first = np.cumsum(n) - n  # where each group's candidates start
        total = int(n.sum())
        cand = flat[np.repeat(start[u] - first, n) + np.arange(total)]
        variant = None if which is None else np.repeat(which, n)
        sc = np.repeat(scale, n)
        xt, wt = np.ascontiguousarray(x.T), np.ascontiguousarray(w.T)
        d2 = np.zeros(total, dtype=F32)
        for i in range(self.dims):
            q = table[0, i][cand] if variant is None else table[variant, i, cand]
            diff = sc * q - np.repeat(xt[i], n)
            d2 += (np.repeat(wt[i], n) * diff) * diff
        best = np.minimum.reduceat(d2, first)  # no NaN: w >= 0 and x, scale*q finite
        _check_found(best < FLT_MAX)
        pos = np.where(d2 == np.repeat(best, n), np.arange(total), total)
        return cand[np.minimum.reduceat(pos, first)]


def _check_found(found: np.ndarray) -> None:
    """ggml keeps a neighbour only if its error is below FLT_MAX, and aborts when none is
    (huge values whose errors overflow float32): refuse those too."""
    if not np.all(found):
        raise WeightValueError(
            "values too large for an IQ grid type: every neighbour's error overflows float32 "
            "(ggml aborts on them)"
        )


IQ2XXS = Grid("iq2xxs", 8, 3, (8, 25, 43), nwant=2, mask=_IQ2XXS_MASK)
IQ2XS = Grid("iq2xs", 8, 3, (8, 25, 43), nwant=2, mask=_IQ2XS_MASK)
IQ2S = Grid("iq2s", 8, 3, (8, 25, 43), nwant=1, mask=_IQ2S_MASK)
IQ1S = Grid("iq1s", 8, 3, (-1, 0, 1), nwant=3, mask=_IQ1S_MASK)  # IQ1_S and IQ1_M
IQ3XXS = Grid("iq3xxs", 4, 8, (4, 12, 20, 28, 36, 44, 52, 62), nwant=2, mask=_IQ3XXS_MASK)
IQ3S = Grid("iq3s", 4, 8, (1, 3, 5, 7, 9, 11, 13, 15), nwant=3, mask=_IQ3S_MASK)


def parity_signs(s7: np.ndarray) -> np.ndarray:
    """ggml's ``ksigns_iq2xs[s7]``: 7 stored sign bits, bit 7 set to their parity."""
    low = (np.asarray(s7) & 127).astype(np.uint8)
    parity = np.unpackbits(low[..., None], axis=-1).sum(axis=-1) & 1
    return low | (parity.astype(np.uint8) << 7)


# --- reading, in any array namespace ------------------------------------------------------------


def lookup(grid: Grid, index: Any, *, xp: Any) -> Any:
    """The dequantized values of grid points ``index`` (integers, any shape), as ggml's
    dequantizers read its grid bytes: ``index.shape + (dims,)`` float32."""
    table = xp.asarray(grid.table, device=array_api_compat.device(index))
    flat = xp.reshape(xp.astype(index, xp.int32), (-1,))
    return xp.reshape(xp.take(table, flat, axis=0), (*index.shape, grid.dims))


def bit_fields(words: Any, width: int, count: int, *, xp: Any, stride: int | None = None) -> Any:
    """The ``count`` fields of ``width`` bits in each word, at bits ``stride*i`` (``stride``
    defaults to ``width``): ``(n, w)`` unsigned or int32 words -> ``(n, w * count)``, the
    fields of word 0 first, lowest first."""
    step = width if stride is None else stride
    mask = (1 << width) - 1
    fields = xp.stack([(words >> (step * i)) & mask for i in range(count)], axis=-1)
    return xp.reshape(fields, (*words.shape[:-1], words.shape[-1] * count))


def sign_factors(signs: Any, *, parity: bool, xp: Any) -> Any:
    """``1.0`` or ``-1.0`` for each of the 8 values of each sign byte (bit i set: value i is
    negative): ``signs.shape + (8,)`` float32. ``parity``: bits 0-6 are stored and bit 7 is
    their parity, as ggml's ``ksigns_iq2xs`` expands them."""
    bits = [(signs >> i) & 1 for i in range(7 if parity else 8)]
    if parity:
        total = bits[0]
        for b in bits[1:]:
            total = total + b
        bits.append(total & 1)
    return 1.0 - 2.0 * xp.astype(xp.stack(bits, axis=-1), xp.float32)


def sign_ints(signs: np.ndarray, *, parity: bool) -> np.ndarray:
    """numpy: the same as int8 ``1`` / ``-1``, ``signs.shape + (8,)``."""
    full = (parity_signs(signs) if parity else np.asarray(signs)).astype(np.uint8)
    bits = np.unpackbits(full[..., None], axis=-1, bitorder="little")
    return (1 - 2 * bits.astype(np.int8)).astype(np.int8)

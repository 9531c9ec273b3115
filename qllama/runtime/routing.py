"""The order in which llama.cpp's CPU ranks a router's experts when values tie.

ggml's argsort (``ops.cpp ggml_compute_forward_argsort_f32``, which ``argsort_top_k`` in
``build_moe_ffn`` calls) sorts the indices 0..n-1 with ``std::sort`` and the comparator
``data[a] > data[b]``. libstdc++'s ``std::sort`` is an introsort: rows of up to 16 are
insertion-sorted (equal values keep ascending index order, what :func:`top_k
<qllama.runtime.model.top_k>` computes with a stable sort), longer rows are partitioned around
a median of three first, which orders equal values its own, deterministic way
(shared/reference/moe_kv_recipes.md 1.6, P2). :func:`stdsort_desc` is that algorithm, step for
step (GCC's ``bits/stl_algo.h`` and ``bits/stl_heap.h``); :func:`break_ties` applies it to the
rows of a routing whose top k meet a tie, the only rows where the two orders can differ.
"""

from __future__ import annotations

import numpy as np

THRESHOLD = 16  # libstdc++'s _S_threshold


def stdsort_desc(values: np.ndarray) -> list[int]:
    """The indices of ``values`` as libstdc++'s ``std::sort`` leaves them under the comparator
    ``values[a] > values[b]`` (ggml's descending argsort)."""
    v = [float(x) for x in values]
    a = list(range(len(v)))

    def comp(i: int, j: int) -> bool:  # comp(*i, *j) on the index values
        return v[i] > v[j]

    def insertion_sort(first: int, last: int) -> None:
        if first == last:
            return
        for i in range(first + 1, last):
            if comp(a[i], a[first]):
                val = a[i]
                a[first + 1 : i + 1] = a[first:i]  # move_backward
                a[first] = val
            else:
                unguarded_linear_insert(i)

    def unguarded_linear_insert(last: int) -> None:
        val = a[last]
        nxt = last - 1
        while comp(val, a[nxt]):
            a[last] = a[nxt]
            last = nxt
            nxt -= 1
        a[last] = val

    def move_median_to_first(result: int, x: int, y: int, z: int) -> None:
        if comp(a[x], a[y]):
            if comp(a[y], a[z]):
                a[result], a[y] = a[y], a[result]
            elif comp(a[x], a[z]):
                a[result], a[z] = a[z], a[result]
            else:
                a[result], a[x] = a[x], a[result]
        elif comp(a[x], a[z]):
            a[result], a[x] = a[x], a[result]
        elif comp(a[y], a[z]):
            a[result], a[z] = a[z], a[result]
        else:
            a[result], a[y] = a[y], a[result]

    def unguarded_partition(first: int, last: int, pivot: int) -> int:
        while True:
            while comp(a[first], a[pivot]):
                first += 1
            last -= 1
            while comp(a[pivot], a[last]):
                last -= 1
            if not first < last:
                return first
            a[first], a[last] = a[last], a[first]
            first += 1

    def push_heap(first: int, hole: int, top: int, value: int) -> None:
        parent = (hole - 1) // 2
        while hole > top and comp(a[first + parent], value):
            a[first + hole] = a[first + parent]
            hole = parent
            parent = (hole - 1) // 2
        a[first + hole] = value

    def adjust_heap(first: int, hole: int, length: int, value: int) -> None:
        top = hole
        child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if comp(a[first + child], a[first + child - 1]):
                child -= 1
            a[first + hole] = a[first + child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            a[first + hole] = a[first + child - 1]
            hole = child - 1
        push_heap(first, hole, top, value)

    def heap_sort(first: int, last: int) -> None:  # __partial_sort(first, last, last)
        length = last - first
        if length >= 2:  # make_heap
            parent = (length - 2) // 2
            while True:
                adjust_heap(first, parent, length, a[first + parent])
                if parent == 0:
                    break
                parent -= 1
        while last - first > 1:  # sort_heap: pop_heap(first, last - 1, last - 1)
            last -= 1
            value = a[last]
            a[last] = a[first]
            adjust_heap(first, 0, last - first, value)

    def introsort_loop(first: int, last: int, depth: int) -> None:
        while last - first > THRESHOLD:
            if depth == 0:
                heap_sort(first, last)
                return
            depth -= 1
            mid = first + (last - first) // 2
            move_median_to_first(first, first + 1, mid, last - 1)
            cut = unguarded_partition(first + 1, last, first)
            introsort_loop(cut, last, depth)
            last = cut

    n = len(a)
    if n:
        introsort_loop(0, n, 2 * (n.bit_length() - 1))
        if n > THRESHOLD:
            insertion_sort(0, THRESHOLD)
            for i in range(THRESHOLD, n):
                unguarded_linear_insert(i)
        else:
            insertion_sort(0, n)
    return a


def break_ties(values: np.ndarray, selected: np.ndarray) -> np.ndarray | None:
    """``selected`` (T, k), the top k of ``values`` (T, n) by index order among equals, with
    every row whose top k meets a tie (two of its first k + 1 sorted values equal) re-ranked
    as llama.cpp's CPU ranks it; None where no row needs it (rows of up to 16 never do)."""
    n = values.shape[1]
    k = selected.shape[1]
    if n <= THRESHOLD:
        return None
    ranked = -np.sort(-values, axis=-1)[:, : min(k + 1, n)]  # (T, k+1) the largest first
    tied = np.flatnonzero((ranked[:, 1:] == ranked[:, :-1]).any(axis=-1))
    if tied.size == 0:
        return None
    out = np.array(selected, copy=True)
    for t in tied.tolist():
        out[t] = stdsort_desc(values[t])[:k]
    return out

"""Box algebra: checked element by element against dense numpy masks."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parashift.vps import boxes as B


def _mask(shape, lo, hi):
    m = np.zeros(shape, dtype=np.int64)
    for a, b in zip(lo, hi):
        m[tuple(slice(x, y) for x, y in zip(a, b))] += 1
    return m


@st.composite
def shapes_and_range(draw):
    d = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=d, max_size=d)))
    n = int(np.prod(shape))
    a = draw(st.integers(0, n - 1))
    b = draw(st.integers(a + 1, n))
    pad = draw(st.integers(0, 2))        # trailing unit dimensions must not change anything
    return shape + (1,) * pad, d, a, b


@settings(max_examples=300, deadline=None)
@given(shapes_and_range())
def test_flat_to_boxes_covers_the_range_exactly(case):
    shape, ndim, a, b = case
    idx, flat, lo, hi = B.flat_to_boxes(np.array([shape]), np.array([a]), np.array([b]))
    assert (idx == 0).all()
    assert len(lo) <= 2 * ndim - 1
    expect = np.zeros(int(np.prod(shape)), dtype=np.int64)
    expect[a:b] = 1
    assert (_mask(shape, lo, hi).ravel() == expect).all()
    assert [np.ravel_multi_index(tuple(x), shape) for x in lo] == flat.tolist()
    assert (np.diff(flat) > 0).all()


def test_flat_to_boxes_many_ranges_at_once():
    shape = np.array([[4, 6, 5], [7, 3, 1], [10, 1, 1]])
    start = np.array([7, 2, 0])
    stop = np.array([101, 20, 10])
    idx, _, lo, hi = B.flat_to_boxes(shape, start, stop)
    for i in range(3):
        sel = idx == i
        m = _mask(tuple(shape[i]), lo[sel], hi[sel]).ravel()
        assert m.sum() == stop[i] - start[i] and m[start[i]:stop[i]].all()


def test_volume_intersect_contains():
    lo = np.array([[0, 0], [2, 2]])
    hi = np.array([[4, 4], [3, 5]])
    assert B.volume(lo, hi).tolist() == [16, 3]
    ilo, ihi = B.intersect(lo[0], hi[0], lo[1], hi[1])
    assert ilo.tolist() == [2, 2] and ihi.tolist() == [3, 4]
    assert B.contains(lo[0], hi[0], ilo, ihi)
    assert not B.contains(lo[0], hi[0], lo[1], hi[1])
    assert B.volume(np.array([[3, 0]]), np.array([[1, 5]])).tolist() == [0]


def test_concat_ranges_and_group_pairs():
    assert B.concat_ranges(np.array([5, 0, 10, 2]), np.array([2, 0, 3, 1])).tolist() == [5, 6, 10, 11, 12, 2]
    assert B.concat_ranges(np.array([]), np.array([])).tolist() == []
    ia, jb = B.group_pairs(np.array([1, 2, 1, 9]), np.array([2, 1, 1]))
    assert sorted(zip(ia.tolist(), jb.tolist())) == [(0, 1), (0, 2), (1, 0), (2, 1), (2, 2)]
    ia, jb = B.self_pairs(np.array([3, 3, 4, 3]))
    assert sorted(zip(ia.tolist(), jb.tolist())) == [(0, 1), (0, 3), (1, 3)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(0, 6), st.integers(1, 4)),
                min_size=1, max_size=6),
       st.lists(st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(0, 6), st.integers(1, 4)),
                min_size=1, max_size=6))
def test_intersect_pairs_matches_masks(a, b):
    def arr(rows):
        lo = np.array([[r[0], r[2]] for r in rows])
        return lo, lo + np.array([[r[1], r[3]] for r in rows])
    alo, ahi = arr(a)
    blo, bhi = arr(b)
    ia, jb, lo, hi = B.intersect_pairs(alo, ahi, blo, bhi)
    for i in range(len(a)):
        for j in range(len(b)):
            both = _mask((12, 12), alo[i:i + 1], ahi[i:i + 1]) * _mask((12, 12), blo[j:j + 1], bhi[j:j + 1])
            k = np.flatnonzero((ia == i) & (jb == j))
            if both.sum() == 0:
                assert len(k) == 0
            else:
                assert len(k) == 1 and (_mask((12, 12), lo[k], hi[k]) == both).all()


def test_exactly_once_accepts_a_tiling_and_names_each_failure():
    rlo, rhi, rg = np.array([[0, 0], [0, 0]]), np.array([[4, 4], [2, 2]]), np.array([0, 1])
    plo = np.array([[0, 0], [2, 0], [0, 0]])
    phi = np.array([[2, 4], [4, 4], [2, 2]])
    pg = np.array([0, 0, 1])
    assert B.exactly_once(rlo, rhi, rg, plo, phi, pg).ok
    # a gap
    cov = B.exactly_once(rlo, rhi, rg, plo[[0, 2]], phi[[0, 2]], pg[[0, 2]])
    assert not cov.ok and cov.group == 0 and "covers 8 of 16" in cov.reason
    # an overlap
    cov = B.exactly_once(rlo, rhi, rg, np.array([[0, 0], [1, 0], [0, 0]]), phi, pg)
    assert not cov.ok and cov.reason == "overlapping pieces"
    # a piece outside its regions
    cov = B.exactly_once(rlo, rhi, rg, plo, phi, np.array([0, 0, 0]))
    assert not cov.ok and cov.reason in ("overlapping pieces", "piece outside its regions")
    cov = B.exactly_once(rlo, rhi, rg, np.array([[0, 0], [2, 0], [0, 0]]), np.array([[2, 4], [4, 4], [2, 3]]), pg)
    assert not cov.ok and cov.reason == "piece outside its regions" and cov.group == 1
    # empty piece
    cov = B.exactly_once(rlo, rhi, rg, np.array([[0, 0]]), np.array([[0, 4]]), np.array([0]))
    assert not cov.ok and cov.reason == "empty piece"


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_covered_volume(dims):
    lo = np.zeros((1, dims), dtype=np.int64)
    hi = np.full((1, dims), 4, dtype=np.int64)
    clo = np.zeros((2, dims), dtype=np.int64)
    chi = np.full((2, dims), 4, dtype=np.int64)
    chi[0, 0] = 1
    clo[1, 0] = 3
    got = B.covered_volume(lo, hi, np.array([7]), clo, chi, np.array([7, 7]))
    assert got.tolist() == [2 * 4 ** (dims - 1)]

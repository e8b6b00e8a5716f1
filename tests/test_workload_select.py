"""Workload.select: rows kept in the given order, parents re-indexed; a repeated row is copied and each copy's
k-th copy follows its parent row's k-th copy (session resampling draws a session more than once; rows stay in
arrival order)."""

from __future__ import annotations

import numpy as np

from kvlab.workload import from_lists


def chain():
    # session 0: rows 0 -> 1 -> 2 (turns); row 3 alone
    return from_lists([[1, 2], [1, 2, 3], [1, 2, 3, 4], [9]], arrival=[0.0, 1.0, 2.0, 3.0],
                      session=[0, 0, 0, 1], turn=[1, 2, 3, 1], parent=[-1, 0, 1, -1])


def test_select_without_repeats_reindexes_parents_and_drops_missing_ones():
    w = chain()
    assert w.select(np.array([0, 1, 2, 3])).parent.tolist() == [-1, 0, 1, -1]
    assert w.select(np.array([1, 2, 3])).parent.tolist() == [-1, 0, -1]  # row 0 not selected
    assert w.select(slice(0, 2)).parent.tolist() == [-1, 0]


def test_select_with_repeats_keeps_each_drawn_session_a_chain_of_its_own():
    w = chain()
    twice = w.select(np.array([0, 0, 1, 1, 2, 2, 3]))  # the session drawn twice, merged by arrival
    assert twice.parent.tolist() == [-1, -1, 0, 1, 2, 3, -1]  # (before: the last copy of each, [.., 1, 1, 3, 3, ..])
    interleaved = w.select(np.array([0, 0, 1, 1, 2]))
    assert interleaved.parent.tolist() == [-1, -1, 0, 1, 2]  # one copy of row 2: it follows the first chain
    assert [interleaved.prompt(i).tolist() for i in range(5)] == [[1, 2], [1, 2], [1, 2, 3], [1, 2, 3],
                                                                  [1, 2, 3, 4]]

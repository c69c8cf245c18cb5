"""The pure routing of the fast tier (globalshard.tiers.routing): which
exchange carries each piece a peer node reads for another in a recovery,
and each piece of the files a tiered save sends to the next nodes."""

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from globalshard.tiers.routing import pieces_of, windows_of

pieces = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.sampled_from(["float32", "uint8"]),
                            st.one_of(st.none(), st.integers(0, 3))), max_size=30)


@settings(max_examples=200)
@given(pieces, st.integers(1, 100))
def test_property_each_piece_from_a_peer_travels_once_and_no_window_carries_more_than_the_limit(drawn, limit):
    """Every piece read by a peer is in one window, no other piece in any;
    in each window a rank sends, and receives, at most ``limit`` bytes, or a
    single piece."""
    needs = [[] for _ in range(4)]
    sources = {}
    for reader, n, dtype, owner in drawn:
        i = len(needs[reader])
        needs[reader].append(["p", -1, [0], [n], dtype])
        sources[(reader, i)] = ("peer", owner) if owner is not None and owner != reader else ("local", reader)
    window = windows_of(needs, sources, limit)
    assert set(window) == {k for k, (kind, _) in sources.items() if kind == "peer"}
    sent, got = defaultdict(list), defaultdict(list)
    for (reader, i), w in window.items():
        n = needs[reader][i][3][0] * (4 if needs[reader][i][4] == "float32" else 1)
        sent[(w, sources[(reader, i)][1])].append(n)
        got[(w, reader)].append(n)
    for sizes in (*sent.values(), *got.values()):
        assert sum(sizes) <= limit or len(sizes) == 1, sizes
    assert sorted(set(window.values())) == list(range(len(set(window.values()))))  # no empty window


@settings(max_examples=300)
@given(st.lists(st.integers(0, 250), max_size=12), st.integers(1, 100))
def test_property_a_senders_files_are_cut_into_pieces_that_cover_each_once_in_windows_of_bounded_size(sizes, limit):
    """Each file is covered by its pieces, in order, without gap or overlap,
    each exactly ``limit`` bytes but the last (an empty file: one empty
    piece); windows count up from 0 in order, none empty, none carrying more
    than ``limit`` bytes."""
    cut = pieces_of(sizes, limit)
    for f, size in enumerate(sizes):
        mine = [(offset, length) for g, offset, length, _ in cut if g == f]
        assert [offset for offset, _ in mine] == [sum(n for _, n in mine[:k]) for k in range(len(mine))]
        assert sum(n for _, n in mine) == size
        assert all(n == limit for _, n in mine[:-1]) and (0 < mine[-1][1] <= limit or size == 0 == mine[-1][1])
    assert [f for f, *_ in cut] == sorted(f for f, *_ in cut)  # in file order
    windows = [w for *_, w in cut]
    assert windows == sorted(windows) and set(windows) == set(range(len(set(windows))))
    for w in set(windows):
        assert sum(length for _, _, length, v in cut if v == w) <= limit

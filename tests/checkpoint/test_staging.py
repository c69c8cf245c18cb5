"""The staging pool's placement: what :meth:`StagingPool.needed` reserves holds
the arrays in any order, and arrays above 1 MiB start on a page (the writer
process writes them to the disk unbuffered, straight from the pool)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from globalshard.checkpoint.staging import StagingPool

SIZES = st.lists(st.integers(0, 3 << 20) | st.integers(0, 5000) | st.just((1 << 20) + 1), max_size=10).filter(any)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), sizes=SIZES)
def test_property_the_reserved_pool_holds_the_arrays_in_any_order_large_ones_on_a_page(data, sizes):
    pool = StagingPool()
    try:
        pool.reserve(StagingPool.needed([np.empty(n, np.uint8) for n in sizes]))
        order = data.draw(st.permutations(sizes))
        pool.reset()
        for n in order:
            array, offset = pool.take((n,), np.uint8)
            alignment = 4096 if n > 1 << 20 else 64
            assert offset % alignment == 0 and array.ctypes.data % alignment == 0
            assert pool.offset_of(array) == offset or n == 0
    finally:
        pool.close()

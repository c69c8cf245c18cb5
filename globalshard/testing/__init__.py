"""Public helpers for testing code that uses globalshard, and for testing
other implementations of the format, as ``zarr.testing`` is for zarr.

* :mod:`globalshard.testing.strategies`: hypothesis strategies for global
  shapes, exact-cover shard layouts (with replicas) and their expected
  values. Needs ``hypothesis`` (``pip install globalshard[test]``).
* :mod:`globalshard.testing.comm`: a real communicator between threads of one
  process (``ThreadGroup``, ``ThreadComm``, ``run_ranks``), for multi-rank
  saves and loads without processes.
* :mod:`globalshard.testing.store`: ``StoreTests``, the tests every
  :class:`~globalshard.store.base.Store` passes (needs ``pytest``).
* :mod:`globalshard.testing.pagecache`: ``evict``, which drops a
  checkpoint's files from the page cache, for cold-read tests.
"""

"""Test helpers users can reuse: hypothesis strategies (``dcpgraph.testing.strategies``).

Importing this package is cheap and needs no test dependency; ``strategies`` needs ``hypothesis``
(the ``test`` extra) and is imported explicitly::

    from dcpgraph.testing import strategies as dst

    @given(dcp=dst.dcp_sizes(), interleave=dst.interleaves(), seed=dst.seeds())
    def test_something(dcp, interleave, seed): ...

Hypothesis draws *configurations and seeds*, never tensor elements: tensors are made from a drawn
seed with a ``torch.Generator``, so a failing example shrinks to a small configuration and a seed
instead of to a tensor full of zeros.
"""

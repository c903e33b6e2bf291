"""Testing tools shipped with kvcm: the conformance suite, reference models and the
fingerprint engine.

A plugin author runs the conformance suite for a plugin with ``kvcm conformance --plugin
NAME``, or by subclassing one base class in a test module::

    from kvcm_core.testing.conformance import TierConformance

    class TestMyTier(TierConformance):
        plugin_name = "mytier"
"""

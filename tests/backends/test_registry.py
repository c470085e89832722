"""The build side's backend registry: the stages ask it what a backend does instead of comparing names."""

from __future__ import annotations

import pytest

from edgesdk import backends
from edgesdk.backends import Backend


def test_the_shipped_backends_and_what_they_do():
    assert [b.name for b in backends.backends()] == ["tvm", "tflite", "onnxruntime"]  # requirements.txt order
    assert [b.name for b in backends.backends() if b.tunes] == ["tvm"]
    assert [b.name for b in backends.backends() if b.quantizes] == ["tflite"]
    assert backends.backend("tvm").runtime_dists == ("apache-tvm", "apache-tvm-ffi")


def test_a_backend_registered_for_a_test_is_forgotten_after_it():
    fake = Backend("fake", runner="onnxruntime", rank=5, runtime_dists=("onnxruntime",))
    with backends.registered(fake):
        assert backends.backend("fake") is fake and backends.backends()[-1] is fake
        with pytest.raises(ValueError, match="already registered"):
            backends.register(fake)
    with pytest.raises(ValueError, match="no backend named 'fake'; known: onnxruntime, tflite, tvm"):
        backends.backend("fake")

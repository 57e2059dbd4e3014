"""Fixtures of the unit tests."""

import pytest

BS = 16


@pytest.fixture
def make_engine(tiny_model_dir, monkeypatch):
    """Builds :class:`support.engine_harness.Engine` objects, closed after the test.

    ``backend`` is a registry name: the built-in ones or the misbehaving
    doubles of :mod:`support.backend_doubles`.
    """
    from support import backend_doubles  # noqa: F401 (registers the doubles)
    from support.engine_harness import Engine

    engines = []

    def make(backend="cpu", **kwargs):
        monkeypatch.setenv("KVOFFLOAD_HAL_BACKEND", backend)
        kwargs.setdefault("num_gpu_blocks", 20)
        kwargs.setdefault("cpu_blocks", 64)
        engine = Engine(tiny_model_dir, block_size=BS, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()

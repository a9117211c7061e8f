"""The one module that imports the C++ extension: everything else takes it from here,
``from lmkit._ext import _engine``, so that a missing build fails with one message that names the fix."""

try:
    from lmkit import _engine
except ImportError as e:
    raise ImportError(
        f"lmkit's C++ engine (lmkit._engine) is not built: {e}. Install with `pip install -e .`"
    ) from None

__all__ = ["_engine"]

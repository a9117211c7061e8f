"""The one module that imports the C++ extension: everything else takes it from here,
``from lmkit._ext import _engine``, so that a missing build fails with one message that names the fix (and an
unknown ``LMKIT_CPU_ISA``, which the engine would ignore, with one that names the choices)."""

from lmkit.env import cpu_isa_cap

cpu_isa_cap()

try:
    from lmkit import _engine
except ImportError as e:
    raise ImportError(
        f"lmkit's C++ engine (lmkit._engine) is not built: {e}. Install with `pip install -e .`"
    ) from None

__all__ = ["_engine"]

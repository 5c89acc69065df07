"""``register_as_neuronxcc()``: make ``import neuronxcc.nki`` resolve to this simulator.

Installs alias entries in ``sys.modules`` (``neuronxcc``, ``neuronxcc.nki``,
``neuronxcc.nki.language``, ``.isa``, ``.typing``, ``.compiler``) so third-party legacy kernels
and their tests run unchanged. Refuses (RuntimeError) when a real neuronx-cc with an ``nki``
subpackage is importable. Idempotent; ``unregister_neuronxcc()`` removes the aliases.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types

_ALIAS_FLAG = "__nki_flash_simulator_alias__"
_SUBMODULES = ("language", "isa", "typing", "compiler")


def _real_neuronxcc_present():
    mod = sys.modules.get("neuronxcc")
    if mod is not None and getattr(mod, _ALIAS_FLAG, False):
        return False
    try:
        spec = importlib.util.find_spec("neuronxcc")
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    for loc in (spec.submodule_search_locations or []):
        if os.path.isdir(os.path.join(loc, "nki")) or os.path.isfile(
                os.path.join(loc, "nki.py")):
            return True
    return False


def is_registered():
    mod = sys.modules.get("neuronxcc")
    return mod is not None and getattr(mod, _ALIAS_FLAG, False)


def register_as_neuronxcc():
    """Alias ``neuronxcc.nki*`` to ``simulate*``. Returns the ``simulate`` package."""
    import simulate as sim
    if is_registered():
        return sim
    if _real_neuronxcc_present():
        raise RuntimeError(
            "register_as_neuronxcc(): a real neuronx-cc with neuronxcc.nki is installed; "
            "refusing to shadow it with the CPU simulator (set NKI_FLASH_BACKEND=simulate and "
            "import simulate directly instead).")
    pkg = types.ModuleType("neuronxcc")
    pkg.__doc__ = "Alias of the nki-flash CPU simulator (simulate/), not the real neuronx-cc."
    pkg.__path__ = []
    pkg.__spec__ = importlib.machinery.ModuleSpec("neuronxcc", None, is_package=True)
    setattr(pkg, _ALIAS_FLAG, True)
    pkg.nki = sim
    sys.modules["neuronxcc"] = pkg
    sys.modules["neuronxcc.nki"] = sim
    for name in _SUBMODULES:
        sys.modules[f"neuronxcc.nki.{name}"] = getattr(sim, name)
    return sim


def unregister_neuronxcc():
    """Remove the aliases installed by :func:`register_as_neuronxcc` (for tests)."""
    if not is_registered():
        return
    for key in ["neuronxcc", "neuronxcc.nki"] + [f"neuronxcc.nki.{n}" for n in _SUBMODULES]:
        sys.modules.pop(key, None)

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


# ---------------------------------------------------------------------------------------------
# register_as_nki(): ``import nki`` -> simulate.nki (the NKI 0.7 front end)
# ---------------------------------------------------------------------------------------------
_NKI_SUBMODULES = ("language", "isa", "typing")


def _real_nki_present():
    """A real ``nki`` package (AWS's NKI compiler, SDK 2.27+) is importable."""
    mod = sys.modules.get("nki")
    if mod is not None:
        return not getattr(mod, _ALIAS_FLAG, False)
    try:
        spec = importlib.util.find_spec("nki")
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    # a namespace package (a directory named nki without __init__.py, e.g. a test folder on
    # sys.path) is not AWS's package; a regular package or a module is
    if spec.origin not in (None, "namespace"):
        return True
    return any(os.path.exists(os.path.join(loc, n))
               for loc in (spec.submodule_search_locations or [])
               for n in ("language", "language.py", "isa", "isa.py"))


def is_nki_registered():
    mod = sys.modules.get("nki")
    return mod is not None and getattr(mod, _ALIAS_FLAG, False)


def register_as_nki():
    """Alias ``nki``, ``nki.language``, ``nki.isa`` to ``simulate.nki*`` (the nki.* front end,
    NKI 0.7). Refuses (RuntimeError) when a real ``nki`` package is installed. Idempotent;
    ``unregister_nki()`` removes the aliases. Returns the ``simulate.nki`` package."""
    import simulate.nki as front
    if is_nki_registered():
        return front
    if _real_nki_present():
        spec = importlib.util.find_spec("nki") if "nki" not in sys.modules else None
        where = getattr(spec, "origin", None) or getattr(sys.modules.get("nki"), "__file__", "?")
        raise RuntimeError(
            f"register_as_nki(): a real 'nki' package is installed ({where}); refusing to "
            "shadow AWS's NKI with the CPU simulator (import simulate.nki directly instead).")
    setattr(front, _ALIAS_FLAG, True)
    sys.modules["nki"] = front
    for name in _NKI_SUBMODULES:
        sys.modules[f"nki.{name}"] = getattr(front, name)
    return front


def unregister_nki():
    """Remove the aliases installed by :func:`register_as_nki` (for tests)."""
    if not is_nki_registered():
        return
    for key in ["nki"] + [f"nki.{n}" for n in _NKI_SUBMODULES]:
        sys.modules.pop(key, None)

"""The backend binding: the only module of ``nki_kernels`` that imports an NKI implementation.

Two choices, two environment variables:

- the NKI *namespace* a launch traces through, ``NKI_FLASH_API`` (:func:`select_api`):
  ``nki`` (NKI 0.7, ``nki.*``: trn2/trn3 on Neuron SDK 2.30+) or ``legacy`` (``neuronxcc.nki``:
  trn1, and trn2 on neuronx-cc 2.20-2.24). ``auto`` (default) picks ``legacy`` for a trn1
  target and ``nki`` otherwise, falling back to ``legacy`` when only neuronx-cc is installed.
- the *backend* of each namespace, ``NKI_FLASH_BACKEND``: AWS's toolchain or the bundled CPU
  simulator (:func:`namespace`; the legacy one is described below).

Kernels written against :mod:`nki_kernels.port` run through either namespace from one source;
the kernels not ported yet use the legacy names ``nki``, ``nl``, ``nisa`` of this module.

The legacy binding ``nki``, ``nl``, ``nisa``: ``neuronxcc.nki`` (and its ``language``/``isa``
modules) or the bundled CPU simulator :mod:`simulate`, chosen by ``NKI_FLASH_BACKEND``:

``auto`` (default)
    ``neuronxcc.nki`` when it is importable, otherwise the bundled simulator.
``neuron``
    ``neuronxcc.nki``; an ImportError explains how to install it when it is missing.
``simulate``
    the bundled simulator, even when neuronx-cc is installed.

``BACKEND`` says which one was bound: ``"neuron"`` or ``"simulate"``. When
``simulate.register_as_neuronxcc()`` has aliased ``neuronxcc.nki`` to the simulator, the binding
reports ``"simulate"``.

The ``nki.*`` binding (bound on first use, so a process that never launches through it never
imports it): AWS's ``nki`` package under ``neuron``, ``simulate.nki`` under ``simulate``, and
under ``auto`` the real package when it is importable, otherwise ``simulate.nki``. Each
:class:`Namespace` carries its own ``backend`` (with only AWS's ``nki`` installed, ``auto``
binds the legacy names to the simulator, as before, and ``nki.*`` to the real package).
"""
import os
from typing import Any, NamedTuple

ENV_VAR = "NKI_FLASH_BACKEND"
CHOICES = ("auto", "neuron", "simulate")

_choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
if _choice not in CHOICES:
    raise ValueError(
        f"{ENV_VAR}: expected one of {', '.join(CHOICES)}, got {os.environ.get(ENV_VAR)!r}"
    )


def _bind_neuron():
    import neuronxcc.nki as nki_mod
    import neuronxcc.nki.isa as nisa_mod
    import neuronxcc.nki.language as nl_mod

    return nki_mod, nl_mod, nisa_mod


def _bind_simulate():
    import simulate as nki_mod
    import simulate.isa as nisa_mod
    import simulate.language as nl_mod

    return nki_mod, nl_mod, nisa_mod


if _choice == "simulate":
    nki, nl, nisa = _bind_simulate()
elif _choice == "neuron":
    try:
        nki, nl, nisa = _bind_neuron()
    except ImportError as exc:
        raise ImportError(
            f"{ENV_VAR}=neuron but neuronxcc.nki cannot be imported ({exc}). Install the legacy "
            "compiler from AWS's Neuron pip repository: pip install 'nki-flash[neuron]' "
            "--extra-index-url https://pip.repos.neuron.amazonaws.com (neuronx-cc >= 2.20, < 2.25), "
            f"or set {ENV_VAR}=simulate to use the bundled CPU simulator."
        ) from exc
else:
    try:
        nki, nl, nisa = _bind_neuron()
    except ImportError:
        nki, nl, nisa = _bind_simulate()

BACKEND = "simulate" if nki.__name__.split(".")[0] == "simulate" else "neuron"


#: neuronx-cc's target override (also read by the bundled simulator).
TARGET_ENV_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"


def active_target():
    """The NeuronCore generation kernels launched now would run on: ``"trn1"``/``"trn2"``/
    ``"trn3"`` on the simulator (its ``measure(target=)``, ``NEURON_PLATFORM_TARGET_OVERRIDE`` or
    default); on the neuron backend the override's value when it names one, else None (the host
    does not probe the device; callers then assume the conservative choice)."""
    if BACKEND != "simulate":
        val = os.environ.get(TARGET_ENV_VAR, "").strip().lower()
        return _TARGET_ALIASES.get(val)
    from simulate import _runtime

    return _runtime.resolve_target({}).name


# nki.jit docstring: the override takes trn1|inf2|gen2, trn2|gen3, trn3|gen4
_TARGET_ALIASES = {"trn1": "trn1", "inf2": "trn1", "gen2": "trn1", "trn2": "trn2",
                   "gen3": "trn2", "trn3": "trn3", "gen4": "trn3"}

# ---------------------------------------------------------------------------------------------
# The namespace selection (NKI_FLASH_API)
# ---------------------------------------------------------------------------------------------

API_ENV_VAR = "NKI_FLASH_API"
API_CHOICES = ("auto", "nki", "legacy")


class Namespace(NamedTuple):
    """One NKI namespace as bound: ``api`` (``"nki"`` or ``"legacy"``), ``backend``
    (``"neuron"`` or ``"simulate"``) and its ``nki``, ``nl``, ``nisa`` modules."""
    api: str
    backend: str
    nki: Any
    nl: Any
    nisa: Any


def _real_nki_importable():
    """AWS's ``nki`` package (not a namespace directory, not the simulator's alias)."""
    import importlib.util
    import sys

    mod = sys.modules.get("nki")
    if mod is not None:
        return mod.__name__.split(".")[0] != "simulate" and hasattr(mod, "jit")
    try:
        spec = importlib.util.find_spec("nki")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def _bind_nki_real():
    import nki as nki_mod
    import nki.isa as nisa_mod
    import nki.language as nl_mod

    return Namespace("nki", "neuron", nki_mod, nl_mod, nisa_mod)


def _bind_nki_simulate():
    import simulate.nki as nki_mod

    return Namespace("nki", "simulate", nki_mod, nki_mod.language, nki_mod.isa)


_NAMESPACES = {}


def namespace(api):
    """The bound :class:`Namespace` of ``api`` (``"nki"`` or ``"legacy"``), bound once."""
    if api not in _NAMESPACES:
        if api == "legacy":
            _NAMESPACES[api] = Namespace("legacy", BACKEND, nki, nl, nisa)
        elif api != "nki":
            raise ValueError(f"api: expected 'nki' or 'legacy', got {api!r}")
        elif _choice == "simulate" or (_choice == "auto" and not _real_nki_importable()):
            _NAMESPACES[api] = _bind_nki_simulate()
        else:
            try:
                _NAMESPACES[api] = _bind_nki_real()
            except ImportError as exc:
                raise ImportError(
                    f"the nki.* namespace (NKI 0.7) is not installed ({exc}): install the Neuron "
                    "SDK 2.33 compiler (pip install neuronx-cc nki --extra-index-url "
                    "https://pip.repos.neuron.amazonaws.com), or set "
                    f"{API_ENV_VAR}=legacy (trn1, or trn2 on neuronx-cc 2.20-2.24), or "
                    f"{ENV_VAR}=simulate") from exc
    return _NAMESPACES[api]


def nki_available():
    """True when ``auto`` may pick ``nki.*``: AWS's ``nki`` package is importable, or nothing
    real is (everything runs on the simulator). With only neuronx-cc installed, kernels stay on
    the legacy toolchain rather than moving to the CPU simulator."""
    return _real_nki_importable() or (_choice != "neuron" and BACKEND == "simulate")


def select_api(target=None):
    """The namespace a launch traces through now: ``NKI_FLASH_API`` (read at every call, so a
    test or a caller may change it), ``auto`` resolved for ``target`` (default
    :func:`active_target`): ``legacy`` on trn1, else ``nki`` when it is available and
    ``legacy`` otherwise (trn2 on neuronx-cc 2.20-2.24 only). A target the installed
    toolchain cannot serve (trn3 with only neuronx-cc, trn1 with only AWS's ``nki``) raises an
    ImportError saying what to install."""
    raw = os.environ.get(API_ENV_VAR, "auto")
    choice = raw.strip().lower() or "auto"
    if choice not in API_CHOICES:
        raise ValueError(f"{API_ENV_VAR}: expected one of {', '.join(API_CHOICES)}, got {raw!r}")
    if choice != "auto":
        return choice
    target = active_target() if target is None else target
    if target == "trn1":
        if _choice == "auto" and BACKEND == "simulate" and _real_nki_importable():
            # AWS's nki is installed, neuronx-cc is not: the legacy names fell back to the CPU
            # simulator, and nki.* kernels do not run on trn1 (nki-today.md §3)
            raise ImportError(
                "trn1 runs only legacy neuronxcc.nki kernels (Neuron SDK <= 2.29) and only AWS's "
                "nki package is installed: pip install 'nki-flash[neuron]' --extra-index-url "
                f"https://pip.repos.neuron.amazonaws.com, or {ENV_VAR}=simulate")
        return "legacy"
    if nki_available():
        return "nki"
    if target == "trn3":
        # no legacy toolchain targets NeuronCore-v4 (nki-today.md §1, §3)
        raise ImportError(
            "trn3 runs only nki.* kernels (Neuron SDK 2.30+) and only neuronx-cc's legacy "
            "neuronxcc.nki is installed: pip install neuronx-cc nki --extra-index-url "
            f"https://pip.repos.neuron.amazonaws.com, or {ENV_VAR}=simulate")
    return "legacy"


__all__ = ["nki", "nl", "nisa", "BACKEND", "ENV_VAR", "active_target", "API_ENV_VAR",
           "API_CHOICES", "Namespace", "namespace", "nki_available", "select_api"]

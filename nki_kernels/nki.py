"""The backend binding: the only module of ``nki_kernels`` that imports an NKI implementation.

Binds ``nki``, ``nl`` and ``nisa`` to ``neuronxcc.nki`` (and its ``language``/``isa`` modules) or to
the bundled CPU simulator :mod:`simulate`, chosen by the environment variable ``NKI_FLASH_BACKEND``:

``auto`` (default)
    ``neuronxcc.nki`` when it is importable, otherwise the bundled simulator.
``neuron``
    ``neuronxcc.nki``; an ImportError explains how to install it when it is missing.
``simulate``
    the bundled simulator, even when neuronx-cc is installed.

``BACKEND`` says which one was bound: ``"neuron"`` or ``"simulate"``. When
``simulate.register_as_neuronxcc()`` has aliased ``neuronxcc.nki`` to the simulator, the binding
reports ``"simulate"``.
"""
import os

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
    """The NeuronCore generation kernels launched now would run on: ``"trn1"``/``"trn2"`` on
    the simulator (its ``measure(target=)``, ``NEURON_PLATFORM_TARGET_OVERRIDE`` or default);
    on the neuron backend the override's value when it names one, else None (the host does not
    probe the device; callers then assume the conservative choice)."""
    if BACKEND != "simulate":
        val = os.environ.get(TARGET_ENV_VAR, "").strip().lower()
        return val if val in ("trn1", "trn2") else None
    from simulate import _runtime

    return _runtime.resolve_target({}).name


__all__ = ["nki", "nl", "nisa", "BACKEND", "ENV_VAR", "active_target"]

"""Energy of a training step: watts while computing and while waiting, and grams of CO2.

[Note: energy model]
A device draws ``power_w`` while it computes (its profile's datasheet TDP, or a measured
draw) and ``idle_power_w`` while it waits: for the pipeline's bubbles, a receive, or a
collective. A step of ``step_s`` seconds in which a device computes ``busy_s`` of them
costs

    E = busy_s * power_w + (step_s - busy_s) * idle_power_w    joules,

and the grams of CO2 are E / 3.6e6 kWh times its zone's grid intensity (carbon_g_per_kwh
in the cluster file). Communication counts as waiting: the copy engines and NICs draw
little next to the SMs, and NCCL's kernels occupy a few of them.
Where a profile gives no idle draw, a waiting device draws IDLE_POWER_FRACTION of its
``power_w``: an assumption, not a measurement. No public number for a GPU that waits
inside a training step (context loaded, clocks up, NCCL kernels spinning) was found; it
lies between the datasheets' idle figures (tens of watts) and the TDP. A measured
profile can state ``idle_power_w`` (nvidia-smi or NVML's power reading during a
step's bubble). Host CPUs, memory, NICs, switches and cooling (a data centre's PUE) are
left out: the figures are the accelerators' own.
"""

from __future__ import annotations

JOULES_PER_KWH = 3.6e6
IDLE_POWER_FRACTION = 0.3  # [assumed] see [Note: energy model]


class NoPowerError(ValueError):
    """A device profile gives no power draw, so no energy can be predicted on it."""


def power_w(device) -> float:
    """Watts ``device`` draws while it computes ([Note: energy model]).

    Raises:
        NoPowerError: its profile gives no ``power_w``.
    """
    if device.power_w is None:
        raise NoPowerError(f"{device.name} has no power_w in its profile: give one with a profile file "
                           "(--profile; power_w and its source, docs/devices.md) to plan for energy")
    return float(device.power_w)


def idle_power_w(device) -> float:
    """Watts ``device`` draws while it waits: its profile's ``idle_power_w``, else IDLE_POWER_FRACTION of ``power_w``.

    Raises:
        NoPowerError: its profile gives no ``power_w``.
    """
    return float(device.idle_power_w) if device.idle_power_w is not None else IDLE_POWER_FRACTION * power_w(device)


def device_energy_j(device, step_s: float, busy_s: float) -> float:
    """Joules one device uses in a step of ``step_s`` seconds, ``busy_s`` of them computing ([Note: energy model]).

    Args:
        busy_s: clipped to 0 .. step_s.

    Raises:
        NoPowerError: the profile gives no ``power_w``.
    """
    busy = min(max(busy_s, 0.0), step_s)
    return busy * power_w(device) + (step_s - busy) * idle_power_w(device)


def grams_co2(joules: float, carbon_g_per_kwh: float) -> float:
    """Grams of CO2 of ``joules`` drawn from a grid of ``carbon_g_per_kwh``."""
    return joules / JOULES_PER_KWH * carbon_g_per_kwh


__all__ = ["IDLE_POWER_FRACTION", "JOULES_PER_KWH", "NoPowerError", "device_energy_j", "grams_co2", "idle_power_w", "power_w"]

"""Which dmuon mode to run, and why (:func:`recommend`), and whether a simulated variant fits the
device (:func:`fits`): the one rule behind ``python -m dmuon simulate``'s "recommended:" line and the
simulation page's notes (:mod:`dmuon.sim._pages.sim_html`). Pure, on :class:`~dmuon.sim._engine.records.Simulation` records."""

from __future__ import annotations

from typing import Any

__all__ = ["fits", "recommend"]


def fits(sim: Any, memory_nbytes: int) -> bool:
    """Every rank's simulated peak within the device's memory (0 = unknown: fits)."""
    return not memory_nbytes or max(sim.peak_memory_nbytes, default=0) <= memory_nbytes


def recommend(sims: dict, memory_nbytes: int) -> tuple[str, str]:
    """``(mode, why)``: the dmuon mode to run, ``"z2"`` or ``"z3"``, and the reason in words: the
    faster of Z2 / Z3 whose peak memory fits the device (Z3 on a tie within 1 %, since it holds
    less); where only one fits, memory decides (and says so); where neither fits, the faster rule,
    and ``why`` says that neither fits."""
    z2, z3 = sims.get("z2"), sims.get("z3")
    if z2 is None or z3 is None:
        mode = "z3" if z3 is not None else "z2"
        return mode, f"the only dmuon mode simulated ({mode.upper()})"
    gib = lambda s: max(s.peak_memory_nbytes, default=0) / 2**30  # noqa: E731
    dev = memory_nbytes / 2**30
    ok = {k: fits(s, memory_nbytes) for k, s in (("z2", z2), ("z3", z3))}
    if ok["z2"] != ok["z3"]:
        mode, other = ("z2", "z3") if ok["z2"] else ("z3", "z2")
        return mode, (
            f"memory decided: {other.upper()} peaks at {gib(sims[other]):.1f} GiB per rank, above the device's "
            f"{dev:.1f} GiB; {mode.upper()} peaks at {gib(sims[mode]):.1f} GiB"
        )
    faster = "z2" if z2.step_s < 0.99 * z3.step_s else "z3"
    if faster == "z2":
        why = f"Z2 is {100 * (1 - z2.step_s / z3.step_s):.1f} % faster than Z3"
    else:
        why = "Z3 is faster than Z2, or within 1 % of it and holds less memory"
    if not ok["z2"]:
        why += f"; neither mode fits the device's {dev:.1f} GiB (Z2 {gib(z2):.1f}, Z3 {gib(z3):.1f} GiB per rank)"
    elif memory_nbytes:
        why += f"; both fit the device's {dev:.1f} GiB"
    return faster, why

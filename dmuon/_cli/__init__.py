"""The command line, ``python -m dmuon {train,plan,diff,simulate,advise,calibrate} ...``: :func:`main`
dispatches to one module per group of subcommands.

* ``train``: the main job (:mod:`dmuon._train`); ``python -m dmuon train --help``.
* ``plan``, ``diff``: :func:`dmuon._cli.plan_commands.main_plan` / :func:`dmuon._cli.plan_commands.main_diff`.
* ``simulate``, ``calibrate``: :func:`dmuon._cli.sim_commands.main_simulate` /
  :func:`dmuon._cli.calibrate_command.main_calibrate`
  (``simulate --pp / --microbatches / --ac``: :mod:`dmuon._cli.pipeline_commands`).
* ``advise``: :func:`dmuon._cli.pipeline_commands.main_advise`.

Subcommand modules are imported only when chosen, so ``train`` does not pay for the others.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

_USAGE = """usage: python -m dmuon {train,plan,diff,simulate,advise,calibrate} [options]

  train   train a small byte-level GPT with dmuon.Muon on FSDP2 (default: 2 CPU processes)
  plan    compile and print a sharding plan
  diff    compare two sharding plans
  simulate  simulated step time of dmuon Z2/Z3 and the alternatives on a hardware model
  advise  the fastest configurations (pp, tp, ep, mesh, Z2/Z3, AC) of a model on G GPUs that fit
  calibrate microbenchmark this machine into a cpu-gloo hardware record (< 3 min)

'python -m dmuon COMMAND --help' for the options of COMMAND."""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        from dmuon._cli.train_command import main as main_train

        return int(main_train(rest) or 0)
    if cmd == "plan":
        from dmuon._cli.plan_commands import main_plan

        return int(main_plan(rest) or 0)
    if cmd == "diff":
        from dmuon._cli.plan_commands import main_diff

        return int(main_diff(rest) or 0)
    if cmd == "simulate":
        from dmuon._cli.sim_commands import main_simulate

        return int(main_simulate(rest) or 0)
    if cmd == "advise":
        from dmuon._cli.pipeline_commands import main_advise

        return int(main_advise(rest) or 0)
    if cmd == "calibrate":
        from dmuon._cli.calibrate_command import main_calibrate

        return int(main_calibrate(rest) or 0)
    print(f"unknown command {cmd!r}\n\n{_USAGE}", file=sys.stderr)
    return 2

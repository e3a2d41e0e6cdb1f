"""The main job: a small byte-level GPT trained with dmuon.Muon on FSDP2.

``python -m dmuon train --help`` lists the flags; :func:`run` is the same job as a function
(returns the metrics dict), :func:`main` the command line.
"""

from dmuon._cli.train_command import main, parse_args, run

__all__ = ["main", "parse_args", "run"]

"""Stage 2 of the planner: owners. ``partition`` is the constrained LPT over owner slots (with
owner groups and initial loads); ``assign`` runs it per matrix class (one owner, owner groups,
expert ranges, expert-parallel ranges) for ``dmuon.plan.compile``."""

"""Stage 2 of the planner: owners. ``partition`` is the constrained LPT over owner slots (with
owner groups and initial loads); ``dmuon.plan.compile`` calls it per matrix class."""

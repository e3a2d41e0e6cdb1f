"""Stage 4 of the planner: the step as data. Every rank's collectives and Newton-Schulz work in
one training step, in order, per hook boundary and phase, and the deadlock check by replay."""

"""Stage 4 of the planner: the step as data. Every rank's collectives and Newton-Schulz work in
one training step, in order, per hook boundary and phase, and the deadlock check by replay.

``ops`` (op kinds, Op, ScheduleError, MicroBatch, Step), ``programs`` (BoundaryProgram,
boundary_programs: each boundary's collectives per phase, bound by the runtime), ``builder``
(``schedule``: the boundary state machine replayed over a Step), ``step_schedule``
(StepSchedule: the op table and its per-rank views), ``replay`` (the deadlock check)."""

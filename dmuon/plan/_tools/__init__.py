"""What a user reads a plan with: ``render`` (``summary()``, HTML), ``diff`` (PlanDiff by FQN),
``cli`` (``python -m dmuon plan`` and ``python -m dmuon diff``)."""

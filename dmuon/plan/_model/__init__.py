"""Stage 1 of the planner: read the model and select what dmuon dedicates.

``snapshot`` (read-only parameter tree: FQNs, shapes, dtypes, ties, module paths),
``boundaries`` (which module's hooks serve a parameter), ``selection`` (the dedicated
parameters), ``experts`` (3-D expert stacks as Muon matrices), ``views`` (per-head / split-QKV
matrix views), ``parallel`` (how one TP / EP rank sees a model not parallelised yet).
"""

"""Pipeline parallelism in the simulator: the schedules (``pp_schedule``), the pipelined step
(``pp_simulate``) and the configuration search behind ``python -m dmuon advise``
(``advise_search``)."""

"""Inside a pass, with torch: the planner a loader talks to, the dataset's own passes, the
channel to the workers, reading and per-sample seeding, plan agreement across ranks,
topology detection, and every private torch attribute (``torch_compat``)."""

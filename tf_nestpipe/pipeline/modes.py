"""The pipeline names and what each means to the train function (one place for them)."""

PIPELINES = ("auto", "none", "dbp", "fwp", "nested")
# Batches a mode routes ahead of the one it computes (0: each batch's exchange in its own step).
LOOKAHEAD = {"none": 0, "fwp": 0, "dbp": 1, "nested": 1}
# Modes that split a batch into micro-batches in a frozen window.
MICRO_BATCHED = ("fwp", "nested")
# The modes `auto` tries, in order: look-ahead-free ones first (switching away from a look-ahead
# costs the steps that train the batches it holds).
AUTO_CANDIDATES = ("none", "fwp", "dbp", "nested")

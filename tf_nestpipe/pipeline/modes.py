"""The pipeline names and what each means to the train function (one place for them)."""

PIPELINES = ("auto", "none", "dbp", "fwp", "nested")
# Batches a mode routes ahead of the one it computes (0: each batch's exchange in its own step).
LOOKAHEAD = {"none": 0, "fwp": 0, "dbp": 1, "nested": 1}
# Modes that split a batch into micro-batches in a frozen window.
MICRO_BATCHED = ("fwp", "nested")
# The modes `auto` tries; the first is its baseline (the others' order is the first probe
# round's; later rounds vary it, see `auto.round_order`).
AUTO_CANDIDATES = ("none", "fwp", "dbp", "nested")

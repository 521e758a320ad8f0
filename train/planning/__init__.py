"""Planning a run before it starts: the memory model of a step on given GPUs (memory.py) and the auto settings it
chooses from (auto.py: micro-batch, recompute, resharding, gradient reduction)."""

"""How good the weights are: the validation loss the trainer logs (validation.py), the action sampler and open-loop
action error (sample.py, open_loop.py behind `python -m train.evaluate`) and a run's curves (curves.py)."""

"""plait calibrate: this machine's speeds (machine.py), plait's own training step
(steps.py) and the tp floor (tp.py), written as a profile the planner reads."""

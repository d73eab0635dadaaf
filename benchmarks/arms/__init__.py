"""benchmarks/sharing.py's modules, one job each: `catalog` (the settings and arms), `lockstep` (an arm's run, a round's
cost, the gate), `curves` (reading a run's curves), `report` (--report) and `plots`."""

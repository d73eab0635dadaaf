"""The soak (issue #73): a swarm and a pipeline left running in the lab for hours with faults on a schedule, and
whether anything they learned was lost.

- plan.py: the fault kinds, the plan (topology, schedule), a fault's record, the processes' settings;
- run.py: the soak itself: its processes started and watched, the schedule, the figures gathered at the end;
- faults.py: one function a fault kind;
- figures.py: what the nodes' files and the soak's samples say (torch-free, but for checkpoint loading);
- hostile.py: the hostile DHT peer, a process of its own in its own namespace;
- __main__.py: the command (`sudo .venv/bin/python -m benchmarks.soak --hours 3 ...`).
"""

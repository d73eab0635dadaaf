"""The benchmarks: scripts run as `python benchmarks/NAME.py` (the commands benchmarks/README.md records), and the
modules behind them, one job each, imported as `benchmarks.NAME` by the scripts and by the tests alike.

Python puts a script's folder, not the repository, on sys.path, so a script that imports from `benchmarks` (or
`tests`) first puts the repository's root there; it never imports a sibling by its bare name (`import lab`), which
would load that module a second time under another name, with classes of its own. node/ and protocol/ need neither:
the project is installed (`pip install -e .`).
"""

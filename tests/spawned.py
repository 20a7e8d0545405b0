"""Runs a stage file with its processes started by spawn, as on macOS, not by fork:

    python tests/spawned.py adapt.py --data synth ...
"""
import multiprocessing
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    sys.path.insert(0, str(Path(__file__).parent.parent))
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")

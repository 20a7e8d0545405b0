"""Runs a stage file as its own process would, appending "RANK FILE" to LOG for each file that it
writes through clip_weights.save_atomic or cli.write_file (RANK as torchrun sets it):

    python -m torch.distributed.run --nproc_per_node 2 tests/record_writes.py LOG adapt.py --data synth ...
"""
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
import cli  # noqa: E402
import clip_weights  # noqa: E402

LOG, sys.argv = sys.argv[1], sys.argv[2:]


def recording(write, path_at):
    def recorded(*args):
        with open(LOG, "a") as log:
            log.write(f"{os.environ.get('RANK', '0')} {Path(args[path_at]).name}\n")
        return write(*args)
    return recorded


clip_weights.save_atomic = recording(clip_weights.save_atomic, 1)
cli.write_file = recording(cli.write_file, 0)
runpy.run_path(sys.argv[0], run_name="__main__")

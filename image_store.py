"""The image store (--cache): every image of a dataset decoded and resized once, at the model's input
size, into one uint8 file beside the data, which the datasets of data.py read in place of the files.
train.prepare_data builds it in turns, rank 0 first (train.in_turns); bench.py times reading it against decoding.
"""
import errno
import functools
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

import cli
import data
from cli import InputError

log = logging.getLogger("image_store")


class ImageStore:
    """Every image of `pairs` resized once to `size` px, kept as uint8 in one memory-mapped file
    `<folder>/store_<size>px.u8` (150 KB an image at 224 px) and called like `read_pixels`, in 0.01 ms where decoding a
    480 x 320 PNG takes 1.7; memory does not grow with the dataset. Its index (`.json`) holds each file's size and
    times: another image list or size, a replaced file (its change time: `cp -p` or `rsync -t` keep its modification
    time), an unreadable index or a store of another length (a copy cut short, a full disk) rebuilds it."""

    def __init__(self, pairs, size, folder):
        files = sorted({os.path.abspath(q) for p in pairs for q in (p.before, p.after, p.distractor) if q})
        self.path, self.size = Path(folder) / f"store_{size}px.u8", size
        self.row = {f: i for i, f in enumerate(files)}
        index_path = self.path.with_suffix(".json")
        stamps = [[f, s.st_size, s.st_mtime_ns, s.st_ctime_ns] for f in files for s in [os.stat(f)]]
        index = {"size": size, "files": stamps}
        try:  # a missing index, or one that is not JSON (a ValueError), rebuilds the store
            same = json.loads(index_path.read_text()) == index
        except (OSError, ValueError):
            same = False
        if not (same and self.path.is_file() and self.path.stat().st_size == len(files) * 3 * size * size):
            try:
                for stale in (index_path, self.path):  # the index first, as it vouches for the pixels; then their space
                    stale.unlink(missing_ok=True)
            except OSError as e:  # a read-only dataset
                raise InputError(f"--cache: cannot write the image store {self.path} ({e.strerror}): pass --no-cache") from None
            build_store(self.path, files, size)
            cli.write_file(index_path, json.dumps(index))
        # Mapped now, the file just checked, which forked loader processes (new at each validation) inherit:
        # mapped later by its path, it may be gone, or hold another image list's rows, as another run that
        # finds the data changed removes and rebuilds it
        self.pixels = self.map()

    def map(self):
        return np.memmap(self.path, np.uint8, "r", shape=(len(self.row), 3, self.size, self.size))

    def __getstate__(self):  # a spawned process (macOS) maps the path itself: pickled, the map would copy every image
        return {**vars(self), "pixels": None}

    def __setstate__(self, state):
        vars(self).update(state)
        self.pixels = self.map()

    def __call__(self, path, size):
        if size != self.size:
            raise InputError(f"{self.path} holds {self.size} px images, not {size} px")
        return torch.from_numpy(np.array(self.pixels[self.row[os.path.abspath(path)]]))


def build_store(path, files, size):
    """Decode and resize `files` on every core into the uint8 file `path`, written whole or not at all."""
    tmp, start = cli.scratch(path, "tmp"), time.time()
    try:
        claim_space(tmp, len(files) * 3 * size * size, path)
        pixels = np.memmap(tmp, np.uint8, "r+", shape=(len(files), 3, size, size))
        with cli.worker_pool(min(data.cores(), 1 + len(files) // 64)) as pool:
            for i, image in enumerate(pool.imap(functools.partial(data.read_array, size=size), files, chunksize=16), 1):
                pixels[i - 1] = image
                if i % 2000 == 0 or i == len(files):
                    rate = i / (time.time() - start)
                    log.info("image store %s: %d/%d images, %.0f/s, eta %s", path, i, len(files), rate,
                             cli.format_eta((len(files) - i) / rate))
        pixels.flush()
        del pixels
        os.replace(tmp, path)
    finally:  # a failed build (an unreadable image, Ctrl-C) leaves no half file: tens of GB at full scale
        tmp.unlink(missing_ok=True)


def claim_space(tmp, nbytes, path):
    """Create `tmp` with its `nbytes` allocated: a full disk is then one line here, not SIGBUS amid a memory map."""
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.truncate(nbytes)
            if nbytes and hasattr(os, "posix_fallocate"):  # not on macOS: the file stays sparse there
                os.posix_fallocate(f.fileno(), 0, nbytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL) and tmp.is_file():  # no allocating ahead here: stays sparse
            return
        size = f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
        room = "make room there, or " if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise InputError(f"--cache: cannot write the image store {path} of {size} ({e.strerror}): {room}pass --no-cache") from None

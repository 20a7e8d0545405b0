"""What every command line here shares, apart from the method: bad input and other expected failures told in
one line, Ctrl-C ended in one line with no process left behind, torchrun's processes and what they gather, the
device and mixed precision, files written whole or not at all, a run folder's lock, and the ETA of progress lines.
A reader of the method can skip this file but for gather_batch, through which the loss sees the global batch."""
import argparse
import contextlib
import errno
import gc
import multiprocessing.resource_tracker
import os
import re
import shutil
import signal
import socket
import sys
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


# ---- Failures told in one line, and Ctrl-C ------------------------------------------------------
class InputError(ValueError):
    """Bad input from the user (a flag, a file, an id): command lines print it as one line (main)."""


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # a full or read-only disk: one line too, not a traceback
ONE_LINE_ERRORS = (InputError, OSError, MemoryError, RuntimeError)  # error_line picks; torch's allocators: RuntimeError
training_begun = False  # set by train.fit; till then, bad input is alike in every process of a machine


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, but a bad flag is refused in one line, not with the usage; under torchrun by each machine's first."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n" if first_of_machine() else None)

    def require_64_bit(self, flag, value):
        if isinstance(value, int) and value >= 2**63:  # else it would fail deep inside torch
            self.error(f"--{flag} {value}: expected a value below 2**63, as torch's sizes and counts are 64-bit")

    def parse_args(self, args=None, namespace=None):
        """An empty value (`--data_root "$DATA"`, the variable unset) is refused, not read as the default."""
        parsed = super().parse_args(args, namespace)
        if empty := [name for name, value in vars(parsed).items() if value == "" or isinstance(value, list) and "" in value]:
            self.error(f"--{empty[0]}: expected a value, got an empty string")
        return parsed


def first_of_machine():
    return os.environ.get("LOCAL_RANK", "0") == "0"  # without torchrun, the only process


def error_line(e):
    """One line for bad input, an unusable file, a full or read-only disk, no memory or a failed download; else None."""
    disk, memory = getattr(e, "errno", None) in DISK_ERRNOS, out_of_memory(e)
    if not (disk or memory or bad_input(e) or isinstance(e, (PermissionError, ConnectionError))):
        return None
    message = str(e)
    if "\nOriginal Traceback" in message:  # raised in a loader process, whose traceback torch prepends
        message = message.splitlines()[-1].split(": ", 1)[-1]
    if memory:  # the allocator's words, after its C++ assertion
        detail = (message.split("DefaultCPUAllocator: ")[-1].splitlines() or [type(e).__name__])[0]
        message = f"out of memory: {detail}; a smaller batch or model, or fewer loader workers, needs less"
    return message


def bad_input(e):
    """Alike in every process of a machine: bad input we name, or a path that names no file to read or write; by
    class where Python has one, as a loader process's failure comes back with its class but without its errno."""
    return (isinstance(e, (InputError, FileNotFoundError, IsADirectoryError, NotADirectoryError, FileExistsError))
            or getattr(e, "errno", None) in (errno.ELOOP, errno.ENAMETOOLONG))


def out_of_memory(e):
    return (isinstance(e, (MemoryError, torch.OutOfMemoryError)) or getattr(e, "errno", None) == errno.ENOMEM
            or "can't allocate memory" in str(e)  # torch's CPU allocator; ENOMEM: a loader process not started
            or str(e).startswith("Storage size calculation overflowed"))  # more bytes than 64 bits count


def end_interrupted(name):
    """Ctrl-C: one line, then end by the signal, as shells expect (a script's loop stops too); else status 130."""
    print(f"{name}: interrupted", file=sys.stderr)
    if os.name == "posix":
        gc.collect()  # a pool's queues, in reference cycles: their semaphores go, else a spawned tracker warns
        for feeder in (t for t in threading.enumerate() if t.name == "QueueFeederThread"):
            feeder.join(timeout=1)  # a closed queue's feeder thread holds two of them until it ends
        sys.stdout.flush(), sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return 130


def main(run, argv=None):
    """Run `run(argv)`: what error_line names ends in one line and status 2, as argparse's; Ctrl-C by its signal."""
    status, name, interrupted = 0, Path(sys.argv[0]).name, False
    try:
        run(argv)
    except ONE_LINE_ERRORS as e:
        if (message := error_line(e)) is None:
            raise
        if training_begun or not bad_input(e) or first_of_machine():  # else its machine's first says it
            print(f"{name}: error: {message}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:  # a training run continues from its last.pt with --resume
        interrupted = True
    if interrupted:  # out of the except clause, the run's frames are gone: its loaders have ended their processes
        status = end_interrupted(name)
    if distributed():
        if status == 0:  # leave together: a process that ends while rank 0 still tests can abort in gloo's teardown
            dist.barrier()
            dist.destroy_process_group()
        # gloo's thread may free the last all-gather's tensors after it returned, which takes the GIL: were the
        # interpreter shutting down by then, the process would abort (SIGABRT). All is written: leave at once.
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(status)
    if status:
        sys.exit(status)


# ---- Processes: torchrun's and a pool's, device and precision ------------------------------------
def distributed():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_batch(x):
    """x of every process in rank order (x in a single process): each computes the loss of the whole global batch.
    Only its own slice carries a gradient, times the number of processes, so that DDP's average is exactly one
    process's gradient on the global batch. An autograd gather would run a collective beside DDP's: unsafe in gloo."""
    if not distributed():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.detach().contiguous())
    parts[dist.get_rank()] = x + (x - x.detach()) * (len(parts) - 1)  # exactly x; its gradient len(parts) times x's
    return torch.cat(parts)


def global_mean(total, count):
    """total / count, count summed over the processes and scaled: DDP's averaged gradient is the global mean's."""
    if distributed():
        count = count.clone()  # all_reduce sums in place: the caller's tensor stays as it was
        dist.all_reduce(count)
        count = count / dist.get_world_size()
    return total / count


def rank():
    return dist.get_rank() if distributed() else 0


def world():
    return dist.get_world_size() if distributed() else 1


def gather_objects(obj):
    """[obj of rank 0, obj of rank 1, ...], on every process."""
    objs = [obj] * world()
    if distributed():
        dist.all_gather_object(objs, obj)
    return objs


def setup_device(cfg):
    """The device --device names; under torchrun also the process group, each process on cuda:LOCAL_RANK."""
    device = None
    with contextlib.suppress(RuntimeError):  # a name torch does not know
        device = torch.device(cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    if device is None or device.type not in ("cpu", "cuda") or device.type == "cpu" and device.index:
        raise InputError(f"--device {cfg.device}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not (device.index or 0) < torch.cuda.device_count():
        raise InputError(f"--device {cfg.device}: {torch.cuda.device_count()} CUDA GPUs are visible")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        if device.type == "cuda":
            if (local := int(os.environ["LOCAL_WORLD_SIZE"])) > (gpus := torch.cuda.device_count()):
                raise InputError(f"torchrun started {local} processes on this machine, one a GPU, but {gpus} CUDA GPUs "
                                 f"are visible: give --nproc_per_node {gpus} or less, or --device cpu")
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        # A long timeout: the other processes wait while rank 0 builds the image store, validates or tests.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(hours=2),
                                device_id=device if device.type == "cuda" else None)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return device


def mixed_precision(device, amp):
    """Autocast context and grad scaler for `amp`: bf16 needs no scaler, fp16 does."""
    if amp == "auto":  # bf16 where the GPU has it natively (Ampere on), not torch's slow emulation of it
        native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        amp = "off" if device.type != "cuda" else "bf16" if native_bf16 else "fp16"
    if amp == "off":
        return contextlib.nullcontext(), None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    return torch.autocast(device.type, dtype=dtype), torch.amp.GradScaler(device.type) if amp == "fp16" else None


@contextlib.contextmanager
def ctrl_c_kept_here():
    """Processes started inside never see Ctrl-C (SIGINT stays blocked, through spawn's exec too); this one ends them
    as it unwinds. Else one dying of it (under spawn, as it imports) prints a traceback and the run fails ("worker
    exited unexpectedly") or goes on. A Ctrl-C meanwhile waits till all have started, lest one read half its data."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield  # Windows; or a thread, which may not set handlers (and gets no Ctrl-C)
        return
    if multiprocessing.get_start_method() != "fork":  # starting spawn's resource tracker unblocks SIGINT: first
        multiprocessing.resource_tracker.ensure_running()
    pressed = []
    handler = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))  # another thread may take the signal
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, handler)  # first runs the handler for a Ctrl-C held till now
    if pressed:
        raise KeyboardInterrupt


def worker_pool(processes):
    """Processes that leave Ctrl-C to this one, which ends them: else each prints a traceback, and the pool may hang."""
    with ctrl_c_kept_here():
        return multiprocessing.Pool(processes)  # a Ctrl-C held meanwhile drops it: gc ends it (end_interrupted)


# ---- Files: made, written whole, never an earlier run's by accident -----------------------------
def check_writable(folder, flag):
    """Refuse a folder that cannot be made or written before any work is done; nothing is created."""
    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if os.path.lexists(p))  # a link to nowhere counts
    if not existing.is_dir():
        raise InputError(f"{flag} {folder}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {folder}: {existing} is not writable")


def take_lock(lock, out):
    """Lock the open file `lock` of the run folder `out`, or refuse a second run there. A POSIX lock (lockf), freed
    when the process dies: a killed run's loader workers would hold a flock for seconds and refuse its --resume."""
    if os.name == "nt":  # no POSIX locks: runs are not locked against a second run on the same folder
        return
    import fcntl
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES, as the system says it
        raise InputError(f"{out} is in use by another run; wait for it, or give another --out_dir") from None


def check_outputs(outputs, overwrite):
    """outputs: (flag, path or None) pairs, refused before any work, creating nothing, where writing harms or fails."""
    for flag, path in ((flag, Path(p)) for flag, p in outputs if p and not is_device(p)):  # devices replace nothing
        if link_target(path).is_dir():  # a loop of links is refused here, not after the work
            raise InputError(f"{path} is a folder: expected a file to write ({flag})")
        if path.name == "metrics.json" and not path.exists() and any((path.parent / n).exists() for n in ("last.pt", ".lock")):
            raise InputError(f"{flag}: {path.parent} holds a run that has not finished, which a metrics.json would mark "
                             f"as finished (--resume refuses it then); give another {flag}")
        if path.exists() and not overwrite:
            raise InputError(f"{path} exists: pass --overwrite to replace it, or another {flag}")
        check_writable(path.parent, flag)


def scratch(path, suffix):
    """`<path>.<host>-<pid>.<suffix>`: `path` is written there, then renamed when whole (of two runs, the last wins).
    What this host's ended writers left is removed first: SIGKILL and SIGTERM skip their clean-up (tens of GB)."""
    path, host = Path(path), socket.gethostname()
    name = re.compile(rf"{re.escape(path.name)}\.{re.escape(host)}-(\d+)\.{re.escape(suffix)}")
    for leftover in path.parent.iterdir() if path.parent.is_dir() else ():
        if (match := name.fullmatch(leftover.name)) and not running(int(match[1])):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    return path.with_name(f"{path.name}.{host}-{os.getpid()}.{suffix}")


@contextlib.contextmanager
def new_folders(folder):
    """Make `folder` and its missing parents, removed again if the block leaves them empty (it failed early)."""
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # the deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        yield
    finally:
        for made_folder in filter(Path.is_dir, made):  # not all were made if making them failed
            if any(made_folder.iterdir()):  # it, and so its parents, hold what the block wrote
                break
            made_folder.rmdir()


def running(pid):
    if os.name == "nt":  # Windows' os.kill ends the process whatever the signal: what it left stays
        return True
    try:
        os.kill(pid, 0)  # no signal is sent: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def read_text(path, expected):
    try:
        return Path(path).read_text(encoding="utf-8-sig")  # a byte-order mark is fine
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError) as e:
        problem = "no such file" if isinstance(e, FileNotFoundError) else f"not a text file ({e})"
        raise InputError(f"{path}: {problem}; expected {expected}") from None


def write_file(path, content):
    """Text or bytes into `path`, whole or not at all (a full disk: one line, no cut file); a device in place."""
    path, content = Path(path), content.encode() if isinstance(content, str) else content
    try:
        if stream := standard_stream(path):  # opened anew, a file it goes to would be cut short, then written over
            stream.flush()  # what was printed before comes first
            stream.buffer.write(content)
            return stream.buffer.flush()
        if is_device(path):  # a pipe, /dev/null, ...
            return path.write_bytes(content)
        (target := link_target(path)).parent.mkdir(parents=True, exist_ok=True)  # a link: the file it names is replaced
        tmp = scratch(target, "tmp")
        try:
            tmp.write_bytes(content)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(OSError):  # on a read-only disk even this fails
                tmp.unlink(missing_ok=True)
    except OSError as e:
        raise InputError(f"{path}: cannot write it ({e.strerror})") from None


def link_target(path):
    target = Path(os.path.realpath(path))  # where links loop, the last is left unresolved
    if target.is_symlink():
        raise InputError(f"{path}: a loop of symbolic links; expected a file to write, or a link to one")
    return target


def standard_stream(path):
    """sys.stdout or sys.stderr if it writes to `path` (/dev/stdout, or the file it is redirected to), else None."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # no such file, or a stream that is no file (a test's capture)
            if os.path.samestat(os.stat(path), os.fstat(stream.fileno())):
                return stream


def is_device(path):
    """Written in place, never replaced: our own stdout or stderr, a pipe, /dev/null, ..."""
    path = Path(path)
    return standard_stream(path) is not None or path.exists() and not (path.is_file() or path.is_dir())


# ---- Progress lines -----------------------------------------------------------------------------
def format_eta(seconds):
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"

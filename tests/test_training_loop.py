import errno
import math
import multiprocessing
import random
from contextlib import nullcontext

import pytest
import torch

import adapt
import cli
import data
import synth
import train
from adapt import AdaptConfig
from clip_weights import save_atomic
from model import Captioner, CaptionerConfig
from train import fit
from tiny import tiny_pair_encoder


class ToyPairs(torch.utils.data.Dataset):
    """Random pairs and captions, keyed like the real datasets by (epoch, index)."""

    def __init__(self, n=26):
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(n, 2, 3, 32, 32, generator=g)
        self.tokens = torch.randint(1, 1000, (n, 12), generator=g)
        self.tokens[:, 8], self.tokens[:, 9:] = 49407, 0

    def __len__(self):
        return len(self.images)

    def __getitem__(self, key):
        epoch, i = key
        swap = random.Random(f"{epoch}-{i}").random() < 0.5  # per-sample randomness from the key alone
        before, after = self.images[i] if not swap else self.images[i].flip(0)
        return before, after, self.tokens[i]


def config(tmp_path, **kw):
    defaults = dict(epochs=2, batch_size=4, workers=0, save_every=4, log_every=100, lr=1e-3, lr_clip=1e-3)
    return AdaptConfig(out_dir=str(tmp_path), device="cpu", **{**defaults, **kw})


def fail_at(model, step, error=KeyboardInterrupt("killed")):
    """The model's `step`-th forward pass raises, as a killed run would stop."""
    forward, calls = model.forward, []

    def failing(*batch):
        calls.append(1)
        if len(calls) == step:
            raise error
        return forward(*batch)

    model.forward = failing


def run(cfg, make_model, kill_at=None):
    """Train a fresh model on ToyPairs, killed at step `kill_at` if given."""
    torch.manual_seed(0)
    model = make_model()
    if kill_at:
        fail_at(model, kill_at)
    fit(cfg, model, ToyPairs(), lambda: (0.0, {}), model.new_parameter_names(), "cosine")
    return model


def captioner():  # its dropout draws from the global RNG: a resumed run must restore it
    return Captioner(tiny_pair_encoder(), CaptionerConfig(layers=1, heads=4, ffn=64, max_len=12))


@pytest.mark.parametrize("make_model,workers", [(tiny_pair_encoder, 0), (tiny_pair_encoder, 1), (captioner, 0)])
def test_resume_reaches_the_same_weights_as_an_uninterrupted_run(tmp_path, make_model, workers):
    whole = run(config(tmp_path / "whole", workers=workers), make_model)
    with pytest.raises(KeyboardInterrupt):
        run(config(tmp_path / "killed", workers=workers), make_model, kill_at=11)  # last.pt: step 8, mid-epoch 2
    assert torch.load(tmp_path / "killed" / "last.pt", weights_only=False)["state"]["step"] == 8
    steps = []

    def counted():  # a restart from scratch would reach the same weights too, in 12 steps
        model = make_model()
        forward = model.forward
        model.forward = lambda *batch: steps.append(1) or forward(*batch)
        return model
    resumed = run(config(tmp_path / "killed", workers=workers, resume=True), counted)
    assert len(steps) == 4  # steps 9 to 12: none of the 8 that last.pt holds is run again
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_run_killed_while_validating_its_last_step_validates_on_resume(tmp_path):
    cfg = config(tmp_path, max_steps=4, save_every=2)  # ends mid-epoch (6 steps an epoch), on a saving step

    def killed():
        raise KeyboardInterrupt("killed")

    torch.manual_seed(0)
    model = tiny_pair_encoder()
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, model, ToyPairs(), killed, model.new_parameter_names(), "cosine")
    assert torch.load(tmp_path / "last.pt", weights_only=False)["state"]["step"] == 2
    state = fit(config(tmp_path, max_steps=4, save_every=2, resume=True), model, ToyPairs(), lambda: (1.0, {}),
                model.new_parameter_names(), "cosine")
    assert [h["step"] for h in state["history"]] == [4] and (tmp_path / "best.pt").exists()


def test_a_run_resumed_where_amp_needs_a_grad_scaler_starts_one(tmp_path, monkeypatch):
    """--amp auto is off on a CPU and fp16 (with a scaler) on a GPU older than Ampere: --device may change."""
    with pytest.raises(KeyboardInterrupt):
        run(config(tmp_path), tiny_pair_encoder, kill_at=6)  # last.pt at step 4, without a scaler
    monkeypatch.setattr(cli, "mixed_precision", lambda device, amp: (nullcontext(), torch.amp.GradScaler("cpu")))
    run(config(tmp_path, resume=True), tiny_pair_encoder)
    last = torch.load(tmp_path / "last.pt", weights_only=False)
    assert last["state"]["step"] == 12 and last["scaler"]["scale"] == 2.0 ** 16


@pytest.mark.parametrize("saved, device, expected", [
    ("stream", "cuda:1", 0),  # trained on cuda:1, resumed on cuda:1 or, other GPUs hidden, on cuda:0
    ("stream", "cuda:0", 0),
    ("stream", "cpu", None),  # a GPU run resumed on a CPU
    ("two GPUs", "cuda:1", 1),  # a last.pt of an earlier version: one stream per GPU then visible
    ("two GPUs", "cuda:0", 0),
    ("two GPUs", "cuda:2", None),  # not visible then
])
def test_a_resumed_run_gets_the_dropout_stream_of_the_gpu_it_trained_on(monkeypatch, saved, device, expected):
    """last.pt keeps the training GPU's stream; --device and the visible GPUs may change on resume."""
    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device)))
    streams = [torch.full((16,), gpu, dtype=torch.uint8) for gpu in range(2)]
    cuda = streams[0] if saved == "stream" else streams
    train.set_rng_state(dict(torch=torch.get_rng_state(), cuda=cuda), torch.device(device))
    assert restored == ([] if expected is None else [(streams[expected], torch.device(device))])


def test_a_rate_of_zero_freezes_its_parameters_and_spares_their_gradients(tmp_path):
    torch.manual_seed(0)
    model = tiny_pair_encoder()
    start, new = {n: p.clone() for n, p in model.named_parameters()}, model.new_parameter_names()
    fit(config(tmp_path, lr_clip=0.0), model, ToyPairs(), lambda: (0.0, {}), new, "cosine")
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, start[n])}
    assert changed == new  # e1, e2, p and their LayerNorm train; CLIP's weights stay as they were
    assert all(p.grad is None for n, p in model.named_parameters() if n not in new)


@pytest.mark.parametrize("error, one_line", [(OSError(errno.ENOSPC, "No space left on device", "out/m.json"), True),
                                             (OSError(errno.EROFS, "Read-only file system", "out/m.json"), True),
                                             (OSError(errno.EIO, "Input/output error", "out/m.json"), False)])
def test_a_full_or_read_only_disk_is_one_line_and_other_failures_keep_their_traceback(capsys, error, one_line):
    def run(argv):
        raise error
    with pytest.raises(SystemExit if one_line else OSError) as raised:
        cli.main(run, [])
    if one_line:
        assert raised.value.code == 2 and capsys.readouterr().err.endswith(f": error: {error}\n")


def test_overwrite_keeps_the_earlier_run_until_the_new_one_saves(tmp_path):
    run(config(tmp_path), tiny_pair_encoder)
    earlier = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(earlier) == ["best.pt", "last.pt"]
    with pytest.raises(KeyboardInterrupt):
        run(config(tmp_path, overwrite=True), tiny_pair_encoder, kill_at=1)  # fails before it has saved anything
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == earlier
    with pytest.raises(KeyboardInterrupt):
        run(config(tmp_path, overwrite=True), tiny_pair_encoder, kill_at=6)  # saved at step 4
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # the earlier best.pt is gone with its run
    assert torch.load(tmp_path / "last.pt", weights_only=False)["state"]["step"] == 4


@pytest.mark.parametrize("grad_clip, clipped", [(0.0, False), (1e9, False), (1e-3, True)])
def test_grad_clip_0_turns_clipping_off(grad_clip, clipped):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = model(torch.ones(2, 4)).sum() * 100
    train.update(model, loss, optimizer, None, grad_clip)
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert norm == pytest.approx(1e-3) if clipped else norm > 100


def test_under_a_grad_scaler_the_true_gradients_are_clipped():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = model(torch.ones(2, 4)).sum() * 100
    train.update(model, loss, optimizer, torch.amp.GradScaler("cpu"), 1e-3)
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert norm == pytest.approx(1e-3)


def test_best_checkpoint_follows_the_validation_score_and_patience_stops_early(tmp_path):
    torch.manual_seed(0)
    model = tiny_pair_encoder()
    scores = iter([1.0, 3.0, 3.0, 2.5, 0.0])  # a tie is no better: the earlier epoch stays best
    cfg = config(tmp_path, epochs=5)
    state = fit(cfg, model, ToyPairs(), lambda: (next(scores), {}), model.new_parameter_names(), "cosine", patience=2)
    assert state["best_epoch"] == 2 and state["best"] == 3.0
    assert [h["epoch"] for h in state["history"]] == [1, 2, 3, 4]  # stopped: 2 epochs without improvement
    assert (tmp_path / "best.pt").exists()


def test_a_progress_line_reports_the_rate_its_step_trained_at(tmp_path, capsys):
    """Warm-up to 1e-3 over the first of 12 steps, then linear decay: the 5th trains at 1e-3 * 8 / 11, the
    10th at 1e-3 * 3 / 11, the last, printed though 12 is no multiple of 5, at 1e-3 / 11, not at the next
    step's rate (0 after the last)."""
    torch.manual_seed(0)
    model = tiny_pair_encoder()
    fit(config(tmp_path, epochs=2, log_every=5, warmup=0.1), model, ToyPairs(), lambda: (0.0, {}),
        model.new_parameter_names(), "linear")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ") and " lr " in line]
    assert [line.split(" lr ")[1].split()[0] for line in lines] == [f"{1e-3 * r / 11:.2e}" for r in (8, 3, 1)]


@pytest.mark.parametrize("diverged, said", [(lambda loss: loss * float("nan"), "nan"),  # as a far too high rate ends
                                            (lambda loss: loss + float("inf"), "inf")],  # the weights stay finite
                         ids=["nan", "inf"])
def test_a_diverged_loss_stops_the_run_at_the_next_progress_line(tmp_path, diverged, said):
    torch.manual_seed(0)
    model = tiny_pair_encoder()
    forward = model.forward
    model.forward = lambda *batch: diverged(forward(*batch))
    message = rf"^step 3: the loss is {said}, training diverged: lower --lr or --lr_clip$"
    with pytest.raises(cli.InputError, match=message):
        fit(config(tmp_path, log_every=3), model, ToyPairs(), lambda: (0.0, {}), model.new_parameter_names(), "cosine")


def test_once_training_has_begun_every_process_says_its_own_error(tmp_path, capsys, monkeypatch):
    """Under torchrun a process may then fail on its own slice of the data: the second of a machine speaks too."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(cli, "training_begun", False)  # as a process starts
    torch.manual_seed(0)
    model = tiny_pair_encoder()
    forward = model.forward
    model.forward = lambda *batch: forward(*batch) * float("nan")
    with pytest.raises(SystemExit):
        cli.main(lambda argv: fit(config(tmp_path, log_every=3), model, ToyPairs(), lambda: (0.0, {}),
                                    model.new_parameter_names(), "cosine"))
    assert capsys.readouterr().err.endswith(": error: step 3: the loss is nan, training diverged: lower --lr or --lr_clip\n")


def test_weights_gone_nan_are_not_saved_over_the_last_good_checkpoint(tmp_path):
    torch.manual_seed(0)
    model, steps = tiny_pair_encoder(), []

    def break_at_step_3():  # an update with inf gradients: the loss is still finite
        steps.append(1)
        if len(steps) == 3:
            next(model.parameters()).data.fill_(float("inf"))
    with pytest.raises(cli.InputError, match=r"^step 4: the weights are not finite, training diverged"):
        fit(config(tmp_path, save_every=2), model, ToyPairs(), lambda: (0.0, {}), model.new_parameter_names(), "cosine",
            after_step=break_at_step_3)
    last = torch.load(tmp_path / "last.pt", weights_only=True)
    assert last["state"]["step"] == 2 and all(w.isfinite().all() for w in last["model"].values())


def test_weights_gone_nan_are_neither_validated_nor_saved_as_best_and_an_overwritten_run_stays(tmp_path):
    torch.manual_seed(0)
    model = tiny_pair_encoder()
    earlier = {name: name.encode() for name in ("last.pt", "best.pt", "metrics.json")}
    for name, content in earlier.items():
        (tmp_path / name).write_bytes(content)

    def break_at_step_6():  # the last step of epoch 1: no last.pt was due before it
        steps.append(1)
        if len(steps) == 6:
            next(model.parameters()).data.fill_(float("nan"))
    steps, validated = [], []
    with pytest.raises(cli.InputError, match=r"^step 6: the weights are not finite, training diverged"):
        fit(config(tmp_path, save_every=100, overwrite=True), model, ToyPairs(), lambda: validated.append(1) or (0.0, {}),
            model.new_parameter_names(), "cosine", after_step=break_at_step_6)
    assert validated == [] and {p.name: p.read_bytes() for p in tmp_path.iterdir()} == earlier


@pytest.mark.parametrize("error, message", [
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),  # torch.save, disk full
     r"cannot write it \(.* unexpected pos 576 vs 534\); is the disk full\?$"),
    (PermissionError(13, "Permission denied"), r"cannot write it \(\[Errno 13\] Permission denied\)$"),
    (RuntimeError("CUDA error: an illegal memory access"), None),  # not a failed write: its traceback stays
])
def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch, error, message):
    path = tmp_path / "last.pt"
    save_atomic({"step": 1}, path)

    def broken_save(obj, f):
        open(f, "wb").write(b"partial")
        raise error

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(cli.InputError if message else RuntimeError, match=rf"^{path}: {message}" if message else "CUDA"):
        save_atomic({"step": 2}, path)
    assert torch.load(path)["step"] == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_schedule_warms_up_then_decays_to_zero():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = train.make_schedule(opt, total_steps=100, warmup=0.1, decay="cosine")
    lrs = []
    for _ in range(100):
        lrs.append(schedule.get_last_lr()[0])
        opt.step()
        schedule.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] > lrs[50] > lrs[99] and lrs[99] < 1e-3


def test_weight_decay_applies_to_matrices_only():
    model = tiny_pair_encoder()
    opt = train.make_optimizer(model, model.new_parameter_names(), AdaptConfig(lr=1e-4, lr_clip=1e-7, weight_decay=0.2))
    for group in opt.param_groups:
        assert all((p.ndim >= 2) == (group["weight_decay"] == 0.2) for p in group["params"])
    new = {id(p) for n, p in model.named_parameters() if n in model.new_parameter_names()}
    for group in opt.param_groups:
        assert all((id(p) in new) == (group["lr"] == 1e-4) for p in group["params"])


def test_optimizer_is_adamw_with_the_runs_beta2_and_eps_1e_6():
    model = tiny_pair_encoder()
    for beta2 in (0.98, 0.999):
        opt = train.make_optimizer(model, model.new_parameter_names(), AdaptConfig(beta2=beta2))
        assert isinstance(opt, torch.optim.AdamW)
        assert all(g["betas"] == (0.9, beta2) and g["eps"] == 1e-6 for g in opt.param_groups)


def test_the_temperature_is_kept_at_least_one_hundredth(tmp_path, monkeypatch):
    synth.write_synth(tmp_path / "synth", 30, seed=5)
    update = train.update

    def overshooting(model, *args):
        update(model, *args)
        model.clip.logit_scale.data.fill_(math.log(1000))
    monkeypatch.setattr(train, "update", overshooting)
    adapt.main(["--data", "synth", "--data_root", str(tmp_path / "synth"), "--out_dir", str(tmp_path / "run"),
                "--max_steps", "2", "--batch_size", "8", "--workers", "0"])
    last = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert last["model"]["clip.logit_scale"].item() == pytest.approx(math.log(100))


def test_resuming_an_early_stopped_run_trains_no_further(tmp_path):
    torch.manual_seed(0)
    model = tiny_pair_encoder()
    scores = iter([3.0, 1.0, 1.0])
    cfg = config(tmp_path, epochs=5)
    fit(cfg, model, ToyPairs(), lambda: (next(scores), {}), model.new_parameter_names(), "cosine", patience=2)
    resumed = config(tmp_path, epochs=5, resume=True)
    fail_at(model, 1, AssertionError("trained after an early stop"))
    state = fit(resumed, model, ToyPairs(), lambda: pytest.fail("validated after an early stop"),
                model.new_parameter_names(), "cosine", patience=2)
    assert state["stopped"] and state["step"] == 3 * 6


@pytest.mark.parametrize("cores, world, device, expected", [
    (2, 1, "cpu", 0),  # the model's two threads use both cores
    (2, 1, "cuda", 1),
    (16, 1, "cpu", 8),
    (16, 1, "cuda", 8),
    (16, 8, "cuda", 1),
    (4, 2, "cpu", 0),
])
def test_loader_workers_follow_the_cores_and_the_device(monkeypatch, cores, world, device, expected):
    monkeypatch.setattr(train.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    assert data.loader_workers(-1, torch.device(device)) == expected
    assert data.loader_workers(3, torch.device(device)) == 3  # --workers as given


def test_an_evaluation_loader_ends_its_processes_with_its_pass_and_a_training_loader_keeps_them():
    before, cpu = set(multiprocessing.active_children()), torch.device("cpu")
    evaluation = data.make_loader(torch.utils.data.TensorDataset(torch.arange(8)), 4, cpu, workers=2)
    assert [len(b) for b, in evaluation] == [4, 4]
    assert set(multiprocessing.active_children()) <= before  # ended as the pass did: a Ctrl-C then is not lost
    training = data.make_loader(list(range(8)), 4, cpu, workers=2, sampler=data.EpochSampler(8, 0, 4))
    assert training.persistent_workers and not evaluation.persistent_workers

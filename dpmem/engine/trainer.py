"""The step loop: sample a logical batch, split it into physical micro-batches, let the method step, evaluate at
an interval, meter memory and throughput, keep the privacy ledger, and leave a summary however the run ends."""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dpmem import distributed, precision, sharding
from dpmem.compiling import Compiler
from dpmem.config import ConfigError, enum_value, resolved_sampling
from dpmem.data import build_data, users
from dpmem.data import fingerprint as data_fingerprint
from dpmem.data.bundle import Grouped, Padded
from dpmem.engine import checkpoint
from dpmem.engine.assemble import Parts, assemble
from dpmem.engine.folder import FolderLock, FolderRefused, as_recorded, claim, write_config
from dpmem.engine.summary import (PRIVACY_LEDGER, DiskFull, append_metrics, append_privacy, cut_metrics, json_ready,
                                  most_spent, privacy_records, summary_table, versions, write_summary)
from dpmem.engine.tracking import NoTracker, open_tracker
from dpmem.metering import Meter
from dpmem.methods import check_fsdp, method_class
from dpmem.methods.subspace import SubspaceProjection, privacy_of
from dpmem.privacy.calibrate import record_of
from dpmem.privacy.accounting import Event
from dpmem.privacy.record import PrivacyUnit, line_epsilon
from dpmem.privacy.sampling import make_batches, user_batches


def resolve_device(name: str) -> torch.device:
    """The run's device; "cuda" is the current GPU (under torchrun, the rank's LOCAL_RANK)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", "cuda was asked for but no CUDA device is available; allowed: auto, cpu")
    if name == "cuda" and distributed.launched() and distributed.local_gpu() is None:
        raise ConfigError("train.device", f"{os.environ.get('LOCAL_WORLD_SIZE')} ranks on a node of "
                          f"{torch.cuda.device_count()} GPUs: start at most one process per GPU, or train.device=cpu")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


def lr_at(step: int, total: int, cfg) -> float:
    """Learning rate for 0-based `step`: linear warm-up, then constant, linear or cosine decay to 0."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    schedule = enum_value(cfg.schedule)
    if schedule == "linear":
        return cfg.lr * (1 - progress)
    if schedule == "cosine":
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr


def run_length(cfg, n: int) -> tuple[int, str]:
    """A run's steps (train.steps, or train.epochs over n examples at the logical batch size; ULS: n users) and its
    sampling (auto: Poisson for a private method, shuffled epochs otherwise)."""
    t = cfg.train
    if t.batch_size > n:
        what = "users" if PrivacyUnit.of(cfg.privacy).uls else "training set"
        raise ConfigError("train.batch_size", f"{t.batch_size} is larger than the {what} ({n})")
    steps = t.steps if t.steps is not None else max(1, math.ceil(t.epochs * n / t.batch_size))
    return steps, resolved_sampling(cfg, method_class(cfg.method.name).spec.private)


def accounting_of(cfg, n: int | None = None, count: int | None = None) -> tuple[Event, int]:
    """What a run of `cfg` over `n` records of `count` users (None: its data's, loaded) is accounted with, before
    anything is built: its Event (σ 0: `dpmem.privacy.calibrate.record_of`) and its steps."""
    if n is None:
        data, _ = users.for_training(cfg.privacy, build_data(cfg.data, cfg.model), cfg.data.split_seed)
        n, count = data.n_train, users.count(data)
    steps, sampling = run_length(cfg, count if PrivacyUnit.of(cfg.privacy).uls and count else n)
    spec = method_class(cfg.method.name).spec
    return record_of(cfg.privacy, spec, n, cfg.train.batch_size, steps, sampling,
                     cfg.method.get("refresh") if spec.private else None, count).event, steps


def config_hash(cfg) -> str:
    """What a privacy.jsonl line names its run's configuration by: the configuration a resume compares, as its
    config.yaml records it (so that `dpmem report` can tell which of a folder's attempts its config.yaml ran)."""
    return hashlib.sha256(json.dumps(as_recorded(cfg), sort_keys=True, default=str).encode()).hexdigest()[:12]


def eval_batch_size(t) -> int:
    """The batch size a run evaluates at (train.eval_batch_size; null = the physical batch size)."""
    return t.eval_batch_size or t.physical_batch_size or t.batch_size


@torch.no_grad()
def evaluate(parts: Parts, batch_size: int) -> float | dict[str, float]:
    """The data set's metric on its evaluation split (accuracy of `predict` unless the task scores itself, maybe
    with other metrics beside it in a dict), the task's functions called through `parts.call`."""
    data, device, autocast = parts.data, parts.device, parts.autocast
    parts.model.eval()
    try:
        if data.score is not None:
            return parts.call(data.score, device, batch_size, autocast)
        correct, n = 0, len(data.test["labels"])
        for start in range(0, n, batch_size):
            batch = {k: v.to(device) for k, v in data.batch(data.test, slice(start, start + batch_size)).items()}
            with autocast():
                correct += int((parts.call(data.predict, batch) == batch["labels"]).sum())
        return correct / max(n, 1)
    finally:
        parts.model.train()


class NonFiniteLoss(RuntimeError):
    """The training loss is NaN or infinite: the run stops, failed, with the ε its steps spent."""


class Terminated(BaseException):
    """The process was sent SIGTERM: the run is interrupted. Not an Exception, so that a sweep stops instead of
    going on to its next run."""


class Run:
    """One training run in `run_dir`. `execute` returns the summary; it never raises for a training failure.

    Under torchrun every rank runs one `Run` on its part of each logical batch (`dpmem.distributed`); rank 0 alone
    writes the run folder (summary, metrics, checkpoints) and evaluates."""

    def __init__(self, cfg, run_dir: Path, data_hook=None, checkpoint: dict | None = None, observers=(),
                 mechanism_of=None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.checkpoint = checkpoint  # the state to resume from (dpmem.engine.folder.claim checked it)
        self.data_hook = data_hook  # changes the data set before anything is sized from it (dpmem audit's canaries)
        self.observers = observers  # see the private step (dpmem audit's canaries, dpmem spectrum's recorder)
        # (calibrated mechanism, model) -> the mechanism the run uses instead (`dpmem.audit.variants`' broken ones)
        self.mechanism_of = mechanism_of
        self.summary: dict = {}
        self.exception: BaseException | None = None  # a training failure or a signal, re-raised by run_training
        self._eps_steps = 0  # the step count epsilon_spent was last computed for
        # the most steps a line of an earlier attempt of this run records: None until a resume has read its ledger
        self._released_steps: int | None = None
        self.main = distributed.is_main()
        # rank 0 evaluates alone, unless FSDP's sharded forward needs every rank (all evaluate; rank 0 records)
        self.evaluates = self.main or cfg.train.fsdp
        self.compiler = None  # train.compile's (dpmem.compiling), made by `prepare`
        self.static_shapes = cfg.train.static_shapes or cfg.train.compile  # a compiled step has one shape

    # -- set-up (configuration errors surface here, before anything is trained) ----------------------------
    def prepare(self) -> Parts:
        """Build the run's parts (dpmem.engine.assemble) and its summary; returns the parts."""
        cfg, t, m = self.cfg, self.cfg.train, self.cfg.method
        self.device = resolve_device(enum_value(t.device))
        why = precision.unsupported(enum_value(t.precision), self.device)
        if why is not None:
            raise ConfigError("train.precision", why)
        self.precision = precision.RunPrecision(enum_value(t.precision), self.device)
        torch.manual_seed(t.seed)
        data = build_data(cfg.data, cfg.model)
        self.data_fingerprint = data_fingerprint(data)  # as loaded (dpmem audit's canaries are the audit's own)
        if self.checkpoint is not None:
            self._check_data()
        data, self.users = users.for_training(cfg.privacy, data, cfg.data.split_seed)  # ELS's bound, once
        uls = PrivacyUnit.of(cfg.privacy).uls
        self.grouped = users.Users(data.users) if uls else None  # ULS samples these
        if self.data_hook is not None:
            data = self.data_hook(data)
        n = data.n_train
        self.steps, self.sampling = run_length(cfg, users.count(data) if uls else n)
        if t.fsdp:
            check_fsdp(m)
        if t.fsdp and distributed.world_size() == 1:
            raise ConfigError("train.fsdp", "shards over the ranks of a torchrun launch; run torchrun "
                              "--nproc_per_node=N -m dpmem train ... with N > 1, or train.fsdp=false")
        self.parts = parts = assemble(cfg, self.device, data, steps=self.steps, sampling=self.sampling,
                                      mesh=sharding.mesh(self.device.type) if t.fsdp else None,
                                      observers=self.observers, mechanism_of=self.mechanism_of)
        parts.autocast = self.precision.autocast
        # one function for the run (a compiled step is traced for the function it is given)
        self.loss_fn = self.precision.forward(parts.per_sample_loss)
        if t.compile:
            if self.observers:
                raise ConfigError("train.compile", "dpmem audit's canaries and dpmem spectrum observe the step "
                                  "eagerly; with them: train.compile=false")
            self.compiler = Compiler(self.device, t.compile_backend, self.precision.tf32)
            parts.method.compile(self.compiler)
        plan = method_class(m.name).spec.clipping(m)
        if t.activation_checkpointing and plan is not None and plan.bookkeeping:
            print("dpmem: warning: book-keeping (method.clipping=bk, method.bookkeeping=true) keeps every layer's "
                  "input and output gradient until the norms are known, which activation checkpointing cannot "
                  "drop; two passes (method.clipping=ghost or mixed; dp-sgd-rc without bookkeeping) are the "
                  "low-memory choice with it", file=sys.stderr)
        subspace = next((o for o in self.method.observers if isinstance(o, SubspaceProjection)), None)
        if subspace is not None:
            ok, why = privacy_of(subspace.source, cfg.data)
            if not ok:
                self.mechanism.mark_leak(why)
        self.summary = {
            "status": "running", "method": m.name, "model": cfg.model.name, "data": cfg.data.name,
            "data_public": cfg.data.public, "seed": t.seed, "device": str(self.device),
            "precision": self.precision.name, **self.mechanism.summary,
            "steps": self.steps, "steps_done": 0, "batch_size": t.batch_size,
            **({"samples_seen": None, "samples_expected": 0.0} if self.mechanism.accounted else {"samples_seen": 0}),
            "physical_batch_size": t.physical_batch_size or t.batch_size, "n_train": n, "lr": t.lr,
            **({"user_data": self.users} if self.users is not None else {}),
            "data_fingerprint": self.data_fingerprint,
            "world_size": distributed.world_size(), "backend": distributed.backend(), "fsdp": t.fsdp,
            "metric_name": self.data.metric_name, "metric_final": None, "metric_best": None, "train_loss": None,
            "peak_memory_bytes": None, "peak_memory_allocated_bytes": None, "peak_memory_source": None,
            "throughput_samples_per_s": None, "wall_time_s": None, "error": None,
            "versions": versions(), "run_dir": str(self.run_dir),
        }
        if self.mechanism.accounted:
            self.summary["released_outside_epsilon"] = self.mechanism.outside_epsilon(self.static_shapes)
        if self.checkpoint is not None:  # what the earlier attempt had done, recorded whatever stops this one
            self.summary.update(self.checkpoint["summary"], resumed_from_step=self.checkpoint["step"])
        if subspace is not None:
            self.summary["subspace"] = {"path": m.subspace.path, "k": subspace.k, "where": subspace.where,
                                        "private": ok, "why": why}
        return parts

    def _check_data(self) -> None:
        """The checkpoint resumes only on the training data it was written on: its steps' batches index those
        examples, and its ε counted them. FolderRefused (nothing written yet) where they changed; a checkpoint of an
        older dpmem, which records none, is resumed unchecked, said so."""
        had, path = self.checkpoint["summary"].get("data_fingerprint"), self.run_dir / checkpoint.FILE
        d = self.cfg.data
        where = f"data.path={d.path}" if d.path else f"data={d.name}"
        if had is None:
            if self.main:
                print(f"dpmem: warning: {path} records no fingerprint of its training data (an older dpmem): it is "
                      f"resumed without checking that {where} is what it trained on", file=sys.stderr)
        elif had != self.data_fingerprint:
            raise FolderRefused("train.resume", f"{path} was written on other training data: {where} changed since "
                                f"(its training split's sha256 {had[:12]} -> {self.data_fingerprint[:12]}); put the "
                                "data back to resume, or another folder (hydra.run.dir=...) for a run on this data")

    # the loop's names for its parts (dpmem.engine.assemble), not copies of them
    data = property(lambda self: self.parts.data)
    model = property(lambda self: self.parts.model)
    method = property(lambda self: self.parts.method)
    mechanism = property(lambda self: self.parts.mechanism)

    def _write_summary(self) -> None:
        if self.compiler is not None:  # how the step was captured: graphs, breaks, recompiles, compile seconds
            self.summary["compiled"] = self.compiler.capture()
        if self._released_steps is not None:
            self.summary["steps_released"] = self._steps_released()
        if self.main:
            write_summary(self.run_dir, self.summary)

    # -- the loop -----------------------------------------------------------------------------------------
    def execute(self) -> dict:
        start = time.perf_counter()
        self._attempt = datetime.datetime.now().isoformat(timespec="seconds")  # names this attempt's ledger lines
        self._config_hash = config_hash(self.cfg)
        resumes = self.checkpoint is not None
        restore = self._catch_signals()
        self.tracker = open_tracker(self.cfg, self.run_dir) if self.main else NoTracker()
        try:
            if self.checkpoint is None:  # a resumed run's folder keeps the earlier summary until it is resumed
                self._write_summary()
                self._spent(event="start")
            with self.precision:
                self._train()
            if self.cfg.train.save_model:
                checkpoint.save_model(self.run_dir, self.cfg, self.parts)
            self.summary["status"] = "ok"
            if self.main:
                checkpoint.remove(self.run_dir)
        except (Exception, KeyboardInterrupt, Terminated) as e:  # the summary records it; the caller decides the exit
            # code. A signal from here on (torchrun's SIGTERM after a collective already failed) must not cut the
            # summary short
            self._ending = True
            if isinstance(e, (KeyboardInterrupt, Terminated)):
                self.summary.update(status="interrupted", error=None if isinstance(e, KeyboardInterrupt) else str(e))
                self.exception = e
            elif isinstance(e, torch.OutOfMemoryError):
                self.summary.update(status="oom", error=str(e).splitlines()[0])
            else:
                self.summary.update(status="failed", error=f"{type(e).__name__}: {e}")
                self.exception = e
        finally:
            self._ending = True
            self.method.close()
            self.summary["wall_time_s"] = time.perf_counter() - start
            # stopped (Ctrl-C, SIGTERM, an error) before the resume read what its earlier attempts released: read
            # now, so that the record never says less than they did
            read_now = resumes and self._read_earlier_release()
            if (done := self.summary["steps_done"]) != self._eps_steps or read_now:
                self.summary["epsilon_spent"] = self.mechanism.epsilon(done)
            # each record written if it can be: a full disk (here, or what failed the run) leaves the earlier lines
            # and summary whole, and ends the run failed, naming the file
            for write in (lambda: self._spent(event="end", status=self.summary["status"]), self._write_summary):
                try:
                    write()
                except OSError as e:
                    if self.exception is None:  # the run ends failed, with what could not be written
                        self.summary.update(status="failed", error=f"{type(e).__name__}: {e}")
                        self.exception = e
                    elif not isinstance(self.exception, DiskFull):  # (a full disk that failed the run says it)
                        print(f"dpmem: warning: the run's end is not recorded: {e}", file=sys.stderr)
            self.tracker.finish(json_ready(self.summary))
            restore()  # only now: a SIGTERM with the default handler back would end the process unrecorded
        return self.summary

    def _spent(self, **fields) -> None:
        """A line of privacy.jsonl (dpmem.engine.summary.append_privacy): ε spent after the steps done, with what it
        was computed from. Private methods only; rank 0 writes it."""
        if not (self.main and self.mechanism.private):
            return
        s = self.summary
        released = {} if self._released_steps is None else {"steps_released": self._steps_released()}
        append_privacy(self.run_dir, {  # what `dpmem report` composes it from
            "attempt": self._attempt, **fields, "steps_done": s["steps_done"], **released,
            "epsilon": s["epsilon_spent"],
            **self.mechanism.ledger_fields(), "config": self._config_hash})

    def _record(self, record: dict) -> None:
        if self.main:
            append_metrics(self.run_dir, record)
            self.tracker.log(json_ready(record))

    def _catch_signals(self):
        """Ctrl-C raises KeyboardInterrupt, SIGTERM (SLURM's scancel, torchrun stopping the other ranks after one
        failed) raises Terminated: the summary says interrupted instead of staying at running. Each is remembered:
        one that lands in a weakref callback (the live-tensor counter's, on every free) is printed and dropped by
        Python, so the loop raises it again at the next step."""
        self._signalled: BaseException | None = None
        self._ending = False
        if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
            return lambda: None

        def on_signal(signum, frame):
            if self._ending:
                return
            if signum == signal.SIGINT:
                self._signalled = KeyboardInterrupt()
            else:
                self._signalled = Terminated("SIGTERM" + (" (torchrun stops every rank when one fails)"
                                                          if distributed.world_size() > 1 else ""))
            raise self._signalled
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

        def restore():
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        return restore

    def _train(self) -> None:
        t, s, log_cfg = self.cfg.train, self.summary, self.cfg.logging
        bar = tqdm(total=self.steps, disable=not (log_cfg.progress and self.main), dynamic_ncols=True, leave=True,
                   mininterval=0.5 if sys.stderr.isatty() else 30.0,  # a log file gets a line per 30 s
                   desc=self.cfg.method.name)
        done = self._resume() if self.checkpoint is not None else 0
        bar.update(done)
        # the batches' sizes are counts of the private data: an accounted run counts the expected q·n per step
        expected = self.mechanism.expected_batch_size if self.mechanism.accounted else None
        samples, loss_sum, loss_count = s["samples_expected" if expected else "samples_seen"], None, 0
        # compiled: no live-tensor counter on the CPU (dynamo refuses a dispatch mode); CUDA's allocator counts
        strategy = self.mechanism.strategy if self.mechanism is not None else None
        self.meter = meter = Meter(self.device, self.steps, 0 if self.compiler is not None else log_cfg.memory_steps,
                                   first=strategy.buffers if strategy is not None else 1)
        try:
            for step, index in enumerate(self.batches()):
                if step < done:  # drawn again and skipped, so the sampler is where the lost run had it
                    continue
                if self._signalled is not None:
                    raise self._signalled
                meter.step_begins(step, self.model, self.method)
                lr, loss = self.train_step(step, self.microbatches(distributed.shard(index)))
                meter.step_ends(step)
                loss_sum = loss if loss_sum is None else loss_sum + loss
                loss_count += expected or len(index)
                samples += expected or len(index)
                s["steps_done"] = step + 1
                s["samples_expected" if expected else "samples_seen"] = samples
                last = step + 1 == self.steps
                record = {}
                if (step + 1) % log_cfg.every == 0 or last:
                    s["epsilon_spent"] = self.mechanism.epsilon(step + 1)
                    self._eps_steps = step + 1
                    self._spent()
                    s["throughput_samples_per_s"] = meter.throughput(samples)
                    s.update(meter.fields())
                    record = {"lr": lr, "epsilon": s["epsilon_spent"], "samples_per_s": s["throughput_samples_per_s"],
                              "memory_bytes": s["peak_memory_bytes"]}
                    shown = {"eps": f"{s['epsilon_spent']:.2f}", "sps": f"{s['throughput_samples_per_s']:.0f}"}
                    if self.loss_key is not None:
                        distributed.sum_([loss_sum])
                        mean_loss = float(loss_sum) / max(loss_count, 1)  # the host sync, once every `every` steps
                        self._check_finite(mean_loss, step)
                        # the last logged window's: a sweeper's train_loss objective
                        s["train_loss" if self.loss_key == "loss" else f"train_{self.loss_key}"] = mean_loss
                        record = {self.loss_key: mean_loss, **record}
                        shown = {self.loss_key.replace("_outside_epsilon", " (not DP)"): f"{mean_loss:.3f}", **shown}
                    else:
                        self._check_finite(None, step)
                    bar.set_postfix(shown, refresh=False)
                    loss_sum, loss_count = None, 0
                if t.eval_every and (step + 1) % t.eval_every == 0 and not last and self.evaluates:
                    record.update(self._evaluate())
                if record:
                    self._record({"step": step + 1, **record})
                    self._write_summary()
                if t.checkpoint_every and (step + 1) % t.checkpoint_every == 0 and not last:
                    self._checkpoint(step + 1)
                bar.update(1)
            if self._signalled is not None:
                raise self._signalled
            if self.evaluates:
                final = self._evaluate()
                s["metric_final"] = final[s["metric_name"]]
                self._record({"step": s["steps_done"], **final, "final": True})
        finally:
            bar.close()
            meter.close()
            s.update(meter.fields())

    @property
    def loss_key(self) -> str | None:
        """The training loss's key in the records: loss (a non-private run's, or released privately), or
        loss_outside_epsilon (an accounted run's, exact: privacy.train_loss=exact); None: not released."""
        release = self.mechanism.loss_release
        if release == "none":
            return None
        return "loss_outside_epsilon" if release == "exact" and self.mechanism.accounted else "loss"

    def _check_finite(self, mean_loss: float | None, step: int) -> None:
        """`NonFiniteLoss` for a NaN or infinite loss, or, where no loss is released, weights (a function of what was
        released)."""
        if mean_loss is None:
            norms = torch._foreach_norm([p.detach() for p in self.model.parameters() if p.requires_grad])
            if torch.stack(norms).isfinite().all():
                return
            what = "the weights are not finite"
        elif math.isfinite(mean_loss):
            return
        else:
            what = f"the training loss is {mean_loss}"
        raise NonFiniteLoss(f"{what} over steps up to {step + 1} (a NaN or infinite input, or a learning rate that "
                            "diverges)")

    # -- checkpoints (dpmem.engine.checkpoint) -------------------------------------------------------------
    def _checkpoint(self, step: int) -> None:
        checkpoint.save(self.run_dir, step, self.cfg, self.parts, {k: self.summary[k] for k in RESUMED
                                                                    if k in self.summary})

    def _resume(self) -> int:
        """The steps done by the earlier run whose checkpoint this run resumes, their state restored. ε spent is
        recomputed for those steps, and is never less than any lost attempt recorded (docs/privacy.md, "Checkpoints
        and resumes"): the steps redone after the checkpoint redraw the same batches and noise, so the most any
        attempt reached, not the checkpoint's, is what was released."""
        state = self.checkpoint
        self.checkpoint = None  # not kept beside the model it was loaded into
        step = checkpoint.restore(state, self.cfg, self.parts)  # the lost run's keys: its batches and noise
        if self.main:
            print(f"dpmem: resuming {self.run_dir} from its checkpoint at step {step}", file=sys.stderr)
        self._read_earlier_release()
        if self.mechanism.reseeded is not None:
            self.summary["noise_reseeded"] = self.mechanism.reseeded
            print(f"dpmem: warning: {self.mechanism.reseeded}, whose states do not carry over: the noise is "
                  f"seeded afresh, so steps after {step} that the earlier run had done are redrawn with new noise "
                  "(what they released then, their metrics, is not in epsilon)", file=sys.stderr)
        self.summary["epsilon_spent"], self._eps_steps = self.mechanism.epsilon(step), step
        self._spent(event="resume", from_step=step)
        if self.main:  # records of the lost steps are written again (and lines cut short dropped)
            cut_metrics(self.run_dir, step)
        self._write_summary()
        return step

    def _read_earlier_release(self) -> bool:
        """What the earlier attempts of this resumed run released, read once (rank 0) from privacy.jsonl
        (dpmem.engine.folder.claim refused a private run whose ledger is missing or unreadable) and the folder's
        summary: ε never goes below it (`spent_before`), nor the steps its records say were released
        (`steps_released`). True where it was read by this call."""
        if not self.main or self._released_steps is not None:
            return False
        epsilon, steps = self._ledger_epsilon()
        self.mechanism.spent_before(max(epsilon, self._summarised_epsilon()))
        self._released_steps = steps
        return True

    def _steps_released(self) -> int:
        """The most steps of this run any attempt released: this one's, or the furthest line of an earlier one."""
        return max(self.summary["steps_done"], self._released_steps or 0)

    def _ledger_epsilon(self) -> tuple[float, int]:
        """The most ε the folder's ledger shows this configuration released, and the most steps a line of it
        records: over every line of it (a start line appended later hides none), each line's ε as recorded or as
        recomputed, whichever is larger; a line whose two disagree is said in one line. Recomputed: each line's from
        its own σ, q, δ and steps (pld, rdp), and the furthest line's from this run's configuration (the
        checkpoint's, which no edit of a line changes; every accountant, rc too)."""
        records = privacy_records(self.run_dir)
        mine = [r for r in records if r.get("config") == self._config_hash] or records
        again = [(line_epsilon(r), r) for r in mine]
        steps = max((n for r in mine for n in (r.get("steps_done"), r.get("steps_released"))
                     if isinstance(n, int) and not isinstance(n, bool)), default=0)
        if furthest := max(mine, key=lambda r: r.get("steps_done") or 0, default=None):
            again.append((self.mechanism.epsilon(steps), furthest))
        again = [(eps, r) for eps, r in again if eps is not None]
        understated = [(eps, r) for eps, r in again if r.get("epsilon") is not None
                       and eps > float(r["epsilon"]) * (1 + 1e-6)]
        if understated:
            eps, r = max(understated, key=lambda pair: pair[0])
            print(f"dpmem: warning: {self.run_dir / PRIVACY_LEDGER}: a line at step {r.get('steps_done')} records "
                  f"epsilon {float(r['epsilon']):.4g}, where its steps give {eps:.4g} (recomputed): the larger is "
                  "kept", file=sys.stderr)
        return max([most_spent(mine) or 0.0, *(eps for eps, _ in again)]), steps

    def _summarised_epsilon(self) -> float:
        """ε the folder's summary (the resumed run's, written after its ledger lines) says was spent: a finite number,
        or 0 where it says none or cannot be read."""
        try:
            eps = json.loads((self.run_dir / "summary.json").read_text()).get("epsilon_spent")
        except (OSError, ValueError, AttributeError):
            return 0.0
        if isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0:
            return float(eps)
        return 0.0

    def train_step(self, step: int, micro: list[dict[str, torch.Tensor]]) -> tuple[float, torch.Tensor]:
        """The method's update for 0-based `step` at its scheduled learning rate: (lr, summed per-sample loss)."""
        lr = lr_at(step, self.steps, self.cfg.train)
        self.method.set_lr(lr)
        return lr, self.method.step(micro, self.loss_fn)

    def microbatches(self, index: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """A logical batch (training-set indices) as physical micro-batches on the device, padded after sampling (q
        is unchanged) with samples that weigh 0: under FSDP every rank runs as many as the fullest rank; under
        train.static_shapes every micro-batch (`Padded`) has the physical batch size, copies of its first example
        filling up the short one."""
        t = self.cfg.train
        physical = t.physical_batch_size or t.batch_size
        chunks = list(index.split(physical)) if len(index) else []
        padding = distributed.most(len(chunks)) - len(chunks) if t.fsdp else 0
        if self.grouped is not None:  # ULS: (users, k) rows, `physical` users to a micro-batch
            empty = torch.full((physical if self.static_shapes else 1, index.shape[1]), -1, dtype=torch.long)
            return [self._users_on_device(c, physical if self.static_shapes else len(c))
                    for c in chunks + [empty] * padding]
        if self.static_shapes:  # every micro-batch a Padded one, full ones too: one code path (and graph) for all
            micro = [Padded(self._on_device(torch.cat([c, c[:1].expand(physical - len(c))])), len(c)) for c in chunks]
        else:
            micro = [self._on_device(chunk) for chunk in chunks]
        size = physical if self.static_shapes else 1
        return micro + [Padded(self._on_device(torch.zeros(size, dtype=torch.long)), 0) for _ in range(padding)]

    def _users_on_device(self, rows: torch.Tensor, size: int) -> Grouped:
        """ULS: the records of `rows` ((users, k) indices, -1 empty) as a `Grouped` micro-batch of `size` users (the
        missing ones padding), an empty slot holding a copy of the data's first record, whose loss weighs 0."""
        rows = torch.cat([rows, rows.new_full((size - len(rows), rows.shape[1]), -1)])
        present = (rows >= 0).reshape(-1)
        index = rows.reshape(-1).clamp(min=0)
        return Grouped(self._on_device(index), rows.shape[1], present.float(), self.device)

    def _on_device(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = self.data.batch(self.data.train, index, trim=not self.static_shapes)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def batches(self):
        """The logical batches of the run's `steps` steps, as the sampler draws them."""
        sampler = self.mechanism.state.batches()
        if self.grouped is not None:
            return user_batches(self.grouped, self.mechanism.sample_rate, int(self.cfg.privacy.records_per_user),
                                self.steps, sampler)
        return make_batches(self.sampling, self.data.n_train, self.cfg.train.batch_size, self.steps, sampler,
                            self.mechanism.groups)

    # -- the way in for tools that drive the steps themselves (dpmem spectrum's layer mode) -----------------
    def steps_on_device(self):
        """(0-based step, its micro-batches on the device) for every logical step, as the loop draws them; step
        with `train_step`, end with `finish`."""
        for step, index in enumerate(self.batches()):
            yield step, self.microbatches(index)

    def finish(self, status: str, steps_done: int) -> dict:
        """Record how a driven run ended (ε for the steps done) and take the method's hooks off the model."""
        self.method.close()
        self.summary.update(status=status, steps_done=steps_done, epsilon_spent=self.mechanism.epsilon(steps_done))
        self._write_summary()
        return self.summary

    def _evaluate(self) -> dict[str, float]:
        """The data set's metrics ({metric_name: value}, and any others its task scores); the best so far of the
        metric, in its direction, and the last evaluation's others (summary's `metrics`) go in the summary."""
        with self.meter.paused():
            value = evaluate(self.parts, eval_batch_size(self.cfg.train))
        values = value if isinstance(value, dict) else {self.data.metric_name: value}
        if len(values) > 1:
            self.summary["metrics"] = values
        value, best = values[self.data.metric_name], self.summary["metric_best"]
        better = max if self.data.higher_is_better else min
        self.summary["metric_best"] = value if best is None else better(best, value)
        return values


# summary fields a resumed run carries over (in its checkpoint: `Run._check_data`); the data set's size (records,
# users) too, from which `dpmem report` accounts a folder whose summary and ledger are gone
RESUMED = ("steps_done", "samples_seen", "samples_expected", "metric_best", "peak_memory_bytes",
           "peak_memory_allocated_bytes", "peak_memory_source", "data_fingerprint", "n_train", "users")


def run_training(cfg, run_dir: Path) -> dict:
    """Claim the folder and prepare (ConfigErrors escape before anything is written), write the config, train,
    summarise."""
    run_dir = Path(run_dir)
    lock = FolderLock(run_dir)  # rank 0 holds it from before it looks into the folder until the run ends
    try:
        checkpoint = claim(cfg, run_dir, lock)
        run = Run(cfg, run_dir, checkpoint=checkpoint)
        run.prepare()
        if distributed.is_main():
            write_config(cfg, run_dir)
        summary = run.execute()
        if distributed.is_main():
            print(summary_table(summary))
        if run.exception is not None:
            raise run.exception
        return summary
    finally:
        lock.release()

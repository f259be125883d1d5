"""User-level privacy (privacy.unit=user): ULS's per-user clipping against torch.func per-record gradients summed per
user in float64, its accounting and ELS's against dp-accounting events built here, the contribution bound, the
users of a data set, and the refusals."""

import csv
import json
import math

import dp_accounting
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy.stats import binom
from torch.func import functional_call, grad, vmap

from dpmem.cli import main
from dpmem.config import ConfigError
from dpmem.data import build_data, fingerprint
from dpmem.data.bundle import Grouped
from dpmem.data.users import Users, bounded, made_up
from dpmem.engine.trainer import Run, run_training
from dpmem.methods import METHODS, validate
from dpmem.methods.clipping_plan import ClippingPlan
from dpmem.methods.privatize import Privatizer
from dpmem.persample.projection import Projection
from dpmem.privacy.accounting import epsilon_spent
from dpmem.privacy.mechanism import GaussianMechanism
from helpers import Layers, config, dies_at, layers_batch, layers_loss, seeded
from text_fixtures import make_tokenizer

K = 2  # records per user in the clipping tests: 10 records, 5 users
PRESENT = torch.tensor([1, 1, 1, 0, 1, 1, 0, 1, 1, 1], dtype=torch.float64)  # two empty slots
C = 0.5


def user_batch():
    """Ten records (two of `layers_batch`'s), K to a user, in float64."""
    a, b = layers_batch(0), layers_batch(1)
    return {k: torch.cat([a[k], b[k]]) for k in a}


def oracle(model, batch, projections=None):
    """(Σ_u min(1, C/‖g_u‖)·g_u, C): g_u the sum of user u's present records' gradients (torch.func, one per
    record), projected where `projections` says (DP-GRAPE), normed over every parameter; C their median norm, so
    that some users are clipped and some not."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p, x, ids, y):
        return layers_loss(lambda *a: functional_call(model, p, a), {"x": x[None], "ids": ids[None],
                                                                      "y": y[None]}).sum()
    per = vmap(grad(one), in_dims=(None, 0, 0, 0))(params, batch["x"], batch["ids"], batch["y"])
    users = {}
    for n, g in per.items():
        g = (g * PRESENT.view(-1, *[1] * (g.dim() - 1))).view(-1, K, *g.shape[1:]).sum(1)
        if projections and n in projections:
            g = torch.stack([projections[n].project(u) for u in g])
        users[n] = g
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in users.values()]).sum(0).sqrt()
    c = float(norms.median())
    factors = (c / (norms + 1e-6)).clamp(max=1.0)
    return {n: (g * factors.view(-1, *[1] * (g.dim() - 1))).sum(0) for n, g in users.items()}, c


def projections_of(model):
    g = torch.Generator().manual_seed(5)
    return {"tokens.weight": Projection(torch.randn(6, 2, generator=g, dtype=torch.float64), 0),
            "flat.weight": Projection(torch.randn(48, 3, generator=g, dtype=torch.float64), 1)}


@pytest.mark.parametrize("plan", ["materialize", "bk", "ghost", "mixed", "fgc", "grape-bk", "grape-materialize"])
def test_per_user_clipped_sum_equals_torch_func_summed_per_user(plan):
    torch.manual_seed(0)
    model = Layers().double()
    batch = user_batch()
    names = dict(model.named_parameters())
    projected = plan.startswith("grape")
    by_name = projections_of(model) if projected else {}
    want, c = oracle(model, batch, by_name)
    with Privatizer(model, GaussianMechanism(0.0, c, 1.0, seeded(3)),
                    plan=ClippingPlan.of(plan.removeprefix("grape-"), projected=projected)) as privatizer:
        projections = {names[n]: proj for n, proj in by_name.items()}
        shapes = {p: want[n].shape for n, p in names.items()}
        got = privatizer.gradient([Grouped(batch, K, PRESENT.float())], layers_loss, shapes, projections).gradient
    for n, p in names.items():
        err = (got[p].double() - want[n]).norm() / want[n].norm()
        assert err < 1e-5, f"{plan}, {n}: relative error {err:.2e}"


def test_an_empty_slot_changes_nothing():
    """A user's empty slot holds some record's copy (the data's first); what it holds must not reach the sum."""
    torch.manual_seed(0)
    model = Layers().double()
    batch, other = user_batch(), user_batch()
    other["x"][3] += 5.0  # slot 3 is empty
    sums = []
    for b in (batch, other):
        with Privatizer(model, GaussianMechanism(0.0, C, 1.0, seeded(3)), plan=ClippingPlan.of("ghost")) as pr:
            g = pr.gradient([Grouped(b, K, PRESENT.float())], layers_loss, {p: p.shape for p in pr.params}).gradient
        sums.append(torch.cat([v.flatten() for v in g.values()]))
    assert torch.equal(sums[0], sums[1])


# -- the users of a data set, and ELS's bound
def test_made_up_users_are_heavy_tailed_and_fixed_by_the_split_seed():
    users = made_up(5000, 500, seed=0)
    counts = torch.bincount(users)
    assert torch.equal(users, made_up(5000, 500, seed=0)) and not torch.equal(users, made_up(5000, 500, seed=1))
    # Zipf's law with exponent 1: user 1 writes about 1/H_500 ≈ 15 % of the records, the median user one or two
    assert 0.12 < counts.max() / 5000 < 0.19
    assert counts[counts > 0].median() <= 3


def test_the_bound_keeps_at_most_k_per_user_and_no_other_users_choice_changes():
    users = made_up(2000, 100, seed=3)
    kept = bounded(users, 3, seed=7)
    per_user = torch.bincount(users[kept])
    assert per_user.max() <= 3
    assert torch.equal(per_user, torch.bincount(users).clamp(max=3))
    # without user 0's records, every other user keeps the same records (indices mapped to the reduced split)
    rest = torch.nonzero(users != 0).squeeze(1)
    kept_rest = rest[bounded(users[rest], 3, seed=7)]
    assert torch.equal(kept_rest, kept[users[kept] != 0])


def test_uls_batches_take_at_most_k_records_of_each_sampled_user():
    users = Users(made_up(500, 50, seed=1))
    rows = users.batch(torch.arange(len(users)).numpy(), 4, key=11).view(-1, 4)
    for u, row in enumerate(rows):
        own = set(users.order[users.starts[u]:users.starts[u + 1]].tolist())
        taken = [r for r in row.tolist() if r >= 0]
        assert len(taken) == min(4, len(own)) and set(taken) <= own


def test_a_csv_user_column_names_the_users_and_the_fingerprint_covers_them(tmp_path):
    tokenizer = make_tokenizer(tmp_path / "tok", "roberta")
    rows = "text,label,author\n" + "".join(f"review {i},{i % 2},{'ann' if i < 6 else 'bob' if i < 9 else i}\n"
                                          for i in range(20))
    (tmp_path / "a.csv").write_text(rows)
    (tmp_path / "b.csv").write_text(rows.replace("bob", "ann"))
    cfgs = [config("data=csv", f"data.path={tmp_path / f}", "data.columns.user=author", "data.test_fraction=0.1",
                   "model=roberta-tiny", f"model.tokenizer={tokenizer}") for f in ("a.csv", "b.csv")]
    data = [build_data(c.data, c.model) for c in cfgs]
    assert data[0].users is not None and len(data[0].users) == data[0].n_train
    assert len(torch.unique(data[0].users)) > len(torch.unique(data[1].users))
    assert fingerprint(data[0]) != fingerprint(data[1])  # the same texts, other authors


# -- accounting: against dp-accounting events built here
def _summary(tmp_path, *overrides, epsilon=8):
    run_training(config("model=vit-tiny", "data=digits", "data.users=300", "privacy.unit=user",
                        "privacy.records_per_user=4", "method=dp-adam", "train.steps=4", "train.batch_size=24",
                        f"privacy.epsilon={epsilon}", "privacy.train_loss=exact", "train.device=cpu",
                        "logging.progress=false", "model.arch.hidden_size=16", "model.arch.num_hidden_layers=1",
                        "model.arch.num_attention_heads=2", "model.arch.intermediate_size=16", *overrides), tmp_path)
    return json.loads((tmp_path / "summary.json").read_text())


def test_uls_is_a_poisson_subsampled_gaussian_over_users(tmp_path):
    s = _summary(tmp_path)
    assert s["status"] == "ok" and s["unit"] == "user" and s["user_sampling"] == "users"
    users = s["users"]
    assert users == s["user_data"]["users"] and users < 300 and s["n_train"] > users  # every record kept
    assert math.isclose(s["sample_rate"], 24 / users)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(24 / users, dp_accounting.GaussianDpEvent(s["sigma"])), s["steps_done"])
    want = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4).compose(event).get_epsilon(
        s["delta"])
    assert want <= s["epsilon_spent"] <= 8 and s["epsilon_spent"] == pytest.approx(want, rel=2e-3)


def test_els_is_a_mixture_of_gaussians_of_a_users_records(tmp_path):
    # a large σ: the mixture's PLD is quick (this test: 20 CPU-s at ε = 0.3, 34 at ε = 1, on 2 cores)
    s = _summary(tmp_path, "privacy.user_sampling=records", epsilon=0.3)
    assert s["status"] == "ok" and s["user_sampling"] == "records"
    assert s["user_data"]["records_left_out"] > 0
    q, k = s["sample_rate"], 4
    assert math.isclose(q, 24 / s["n_train"])
    mixture = dp_event.MixtureOfGaussiansDpEvent(s["sigma"], [0, 1, 2, 3, 4],
                                                 [binom.pmf(j, k, q) for j in range(k + 1)])
    # the oracle's grid (5e-4) nests in dpmem's (1e-3), so its pessimistic ε stays at or below dpmem's
    want = pld_privacy_accountant.PLDAccountant(value_discretization_interval=5e-4).compose(
        dp_accounting.SelfComposedDpEvent(mixture, s["steps_done"])).get_epsilon(s["delta"])
    assert want <= s["epsilon_spent"] <= 0.3 and s["epsilon_spent"] == pytest.approx(want, rel=2e-3)
    # a user of k records costs more than a record: the same σ at the record level spends less
    assert epsilon_spent(s["sigma"], s["delta"], q, s["steps_done"]) < s["epsilon_spent"]


@pytest.mark.parametrize("understated, target, q, steps, k", [
    (0, 0.3, 0.1, 1, 2),  # the fine root within the tolerance below the coarse one
    (0, 0.1, 0.05, 2, 2),  # further below: bracketed by doubling steps
    (0.05, 0.1, 0.05, 2, 2),  # a search grid that understates ε (its root below): the search on the fine grid
])
def test_els_calibration_finds_the_fine_grids_sigma(monkeypatch, understated, target, q, steps, k):
    """calibrate_sigma searches ELS's mixture on a coarser grid and brackets the fine root from it: the σ is
    dp-accounting's own calibration of the same mixture on dpmem's grid, to the tolerance."""
    from dpmem.privacy import accounting
    fine, real = accounting.PLD_DISCRETIZATION, accounting._mixture_epsilon
    monkeypatch.setattr(accounting, "_mixture_epsilon", lambda *a, interval=fine: real(
        *a, interval=interval) - (understated if interval != fine else 0))
    accounting.sigma_for.cache_clear()
    delta, tolerance = 1e-5, 1e-3
    sigma = accounting.calibrate_sigma(target, delta, q, steps, user_records=k)
    accounting.sigma_for.cache_clear()

    def event(s):
        mixture = dp_event.MixtureOfGaussiansDpEvent(s, list(range(k + 1)), [binom.pmf(j, k, q) for j in range(k + 1)])
        return dp_accounting.SelfComposedDpEvent(mixture, steps)

    want = dp_accounting.calibrate_dp_mechanism(
        lambda: pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3), event, target, delta,
        dp_accounting.ExplicitBracketInterval(0.95 * sigma, 1.05 * sigma), tol=tolerance)  # (a PLD at σ < 1: seconds)
    assert epsilon_spent(sigma, delta, q, steps, user_records=k) <= target
    assert abs(sigma - want) <= tolerance + 1e-9, (sigma, want)


@pytest.mark.parametrize("overrides, key", [
    (("privacy.unit=user",), "privacy.records_per_user"),
    (("privacy.records_per_user=4",), "privacy.records_per_user"),
    (("privacy.unit=user", "privacy.records_per_user=4", "method=adam", "privacy=none"), "privacy.unit"),
    (("privacy.unit=user", "privacy.records_per_user=4", "method=dp-sgd-rc"), "privacy.unit"),
    (("privacy.unit=user", "privacy.records_per_user=4", "method=dpzero"), "privacy.user_sampling"),
    (("privacy.unit=user", "privacy.records_per_user=4", "privacy.user_sampling=records", "privacy.accountant=rdp"),
     "privacy.accountant"),
    (("privacy.unit=user", "privacy.records_per_user=4", "privacy.noise=bandmf", "privacy.bands=2"), "privacy.noise"),
    (("privacy.unit=user", "privacy.records_per_user=4", "privacy.neighbouring=replace_one"),
     "privacy.neighbouring"),
    (("privacy.unit=user", "privacy.records_per_user=4", "train.sampling=fixed"), "train.sampling"),
    (("data.users=0",), "data.users"),
])
def test_user_level_refusals_name_their_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        validate(config("data.users=50", "privacy=eps8", *overrides))
    assert e.value.key == key


def test_a_user_run_on_data_without_users_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="names no users"):
        run_training(config("privacy.unit=user", "privacy.records_per_user=2", "train.steps=1",
                            "train.device=cpu", "logging.progress=false"), tmp_path)


# -- compiled, resumed
SMALL_VIT = ("model=vit-tiny", "data=digits", "data.users=120", "privacy.unit=user", "privacy.records_per_user=3",
             "model.arch.hidden_size=16", "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2",
             "model.arch.intermediate_size=16", "model.arch.patch_size=4", "train.batch_size=12",
             "train.physical_batch_size=8", "privacy.epsilon=1", "privacy.noise_seed=3", "privacy.sampler_seed=3",
             "train.device=cpu", "logging.progress=false", "logging.memory_steps=0")


class Kept:
    """Each run's `Run`, by folder name, so that a test can compare the trained weights."""

    def __init__(self, monkeypatch):
        self.runs, real = {}, Run.execute

        def keep(run):
            self.runs[run.run_dir.name] = run
            return real(run)
        monkeypatch.setattr("dpmem.engine.trainer.Run.execute", keep)

    def weights(self, name):
        return torch.cat([p.detach().flatten() for p in self.runs[name].model.parameters()])


@pytest.mark.parametrize("method", [("method=dp-adam",), ("method=grape", "method.rank=4", "method.refresh=2")])
def test_a_compiled_uls_step_is_one_graph_and_trains_as_the_eager_one(tmp_path, monkeypatch, method):
    kept = Kept(monkeypatch)
    eager = run_training(config(*SMALL_VIT, *method, "train.steps=3", "train.static_shapes=true"), tmp_path / "eager")
    compiled = run_training(config(*SMALL_VIT, *method, "train.steps=3", "train.compile=true",
                                   "train.compile_backend=eager"), tmp_path / "compiled")
    assert eager["status"] == compiled["status"] == "ok" and compiled["epsilon_spent"] == eager["epsilon_spent"]
    capture = json.loads((tmp_path / "compiled" / "summary.json").read_text())["compiled"]
    assert capture["graphs_per_function"] == {"microbatch": 1} and capture["recompiles"] == 0, capture
    torch.testing.assert_close(kept.weights("compiled"), kept.weights("eager"), rtol=1e-5, atol=1e-6)


def test_a_uls_run_that_dies_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    kept = Kept(monkeypatch)
    cfg = config(*SMALL_VIT, "method=dp-adam", "train.steps=5", "train.checkpoint_every=2")
    oracle = run_training(cfg, tmp_path / "oracle")
    real_step = dies_at(monkeypatch, METHODS["dp-adam"], 4)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(cfg, tmp_path / "resumed")
    monkeypatch.setattr(METHODS["dp-adam"], "step", real_step)
    resumed = run_training(cfg, tmp_path / "resumed")
    assert resumed["resumed_from_step"] == 2 and resumed["epsilon_spent"] == oracle["epsilon_spent"]
    assert torch.equal(kept.weights("resumed"), kept.weights("oracle"))


def test_the_report_labels_the_unit_and_never_composes_a_users_and_a_records_epsilon(tmp_path, capsys):
    root = tmp_path / "runs"
    tiny = [o for o in SMALL_VIT if not o.startswith(("privacy.unit", "privacy.records_per_user", "privacy.noise_seed",
                                                        "privacy.sampler_seed", "privacy.epsilon"))]
    for name, unit in (("r1", ()), ("r2", ()), ("u1", ("privacy.unit=user", "privacy.records_per_user=3")),
                       ("u2", ("privacy.unit=user", "privacy.records_per_user=3"))):
        run_training(config(*tiny, "method=dp-adam", "train.steps=2", "privacy.epsilon=2", *unit), root / name)
    main(["report", str(root), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "report.md").read_text()
    rows = {r["epsilon"] for r in csv.DictReader((tmp_path / "out" / "report.csv").open())}
    assert rows == {"2", "2 (per user)"}
    composed = [line for line in md.splitlines() if "private releases on the same training data" in line]
    assert len(composed) == 2, md  # one per unit: the two records' runs, and the two users' runs
    assert sum("user-level ε" in line for line in composed) == 1
    # each line's ε is its two runs' composed at its own unit's accounting: a user-level one costs more
    user, record = sorted(composed, key=lambda line: "user-level" not in line)
    assert float(user.split("ε = ")[1].split()[0]) > 0 and float(record.split("ε = ")[1].split()[0]) > 0


@pytest.mark.parametrize("clipping", ["bk", "ghost"])
def test_the_plan_of_a_uls_step_equals_the_trainers_counted_peak(tmp_path, clipping):
    """A user step holds its users' k record slots each: `dpmem memory` plans it from k, as the trainer counts it
    (static shapes: every micro-batch B users × k slots)."""
    from dpmem.engine.planner import plan
    every = config(*SMALL_VIT, "data.users=20")
    count = len(torch.unique(build_data(every.data, every.model).users))  # every user at every step: q = 1
    run = [*SMALL_VIT, "data.users=20", "method=dp-adam", f"method.clipping={clipping}", "train.steps=3",
           "logging.memory_steps=2", f"train.physical_batch_size={count}", f"train.batch_size={count}",
           "privacy.accountant=rdp", "memory.target=cpu"]
    summary = run_training(config(*run), tmp_path)
    assert summary["status"] == "ok" and summary["peak_memory_source"] == "live_tensors"
    planned = plan(config(*run))
    assert planned["training"]["peak_bytes"] == pytest.approx(summary["peak_memory_bytes"], rel=0.01)
    # a record step of as many records (B·k) holds no more: the slots are records, and a user's joined tokens make
    # its T×T Gram matrices k² times a record's (k times per record)
    record = plan(config(*[o for o in run if not o.startswith("privacy.")], f"train.batch_size={3 * count}",
                         f"train.physical_batch_size={3 * count}"))
    assert planned["training"]["peak_bytes"] >= record["training"]["peak_bytes"]


# -- the audit: canaries are users
def audit_config(*overrides):
    tiny = ["model.arch.hidden_size=8", "model.arch.num_hidden_layers=1", "model.arch.num_attention_heads=2",
            "model.arch.intermediate_size=16", "model.arch.patch_size=4"]
    return config("logging.memory_steps=0", "privacy=eps2", "privacy.noise_seed=1", "privacy.sampler_seed=1",
                  "train.steps=10", "audit.canaries=500", "data.users=3000", "privacy.unit=user",
                  "privacy.records_per_user=4", "method=dp-adam", "train.device=cpu", *tiny, *overrides)


# ELS at q ≈ 0.8 calibrates through mixture PLDs built from σ = 1 up (about 40 CPU-s): its σ is given, just above
# the 20.81 that privacy=eps2 calibrates to, so that its claim stays below 2 (test_els_is_a_mixture_... calibrates)
@pytest.mark.parametrize("sampling, batch, sigma", [("users", 400, []), ("records", 700, ["privacy.noise_multiplier=21"])],
                         ids=["users-400", "records-700"])
def test_a_user_level_run_audits_below_its_claim_with_canary_users(tmp_path, sampling, batch, sigma):
    from dpmem.audit import run_audit
    record, _ = run_audit(audit_config(f"privacy.user_sampling={sampling}", f"train.batch_size={batch}", *sigma),
                          tmp_path)
    assert record["plant"] == "sum" and not record["flagged"], record
    assert record["epsilon_lower_bound"] < record["epsilon_claimed"] <= 2.0


def test_the_audit_flags_records_clipped_alone_under_a_users_claim(tmp_path):
    """A canary user's 4 records, each a gradient of 10 C at the canary's coordinate: clipped as one user they move
    the sum by C, clipped alone by 4 C, which the bound sees far above the claim."""
    from dpmem.audit import run_audit, variants
    record, _ = run_audit(audit_config("train.batch_size=400"), tmp_path,
                          mechanism_of=variants.records_clipped_alone())
    assert record["flagged"] and record["epsilon_lower_bound"] > record["epsilon_claimed"], record


def test_a_user_level_audit_refuses_batch_and_input_canaries(tmp_path):
    from dpmem.audit import check, planting
    with pytest.raises(ConfigError, match="user of k records"):
        planting(audit_config("audit.plant=batch"))
    with pytest.raises(ConfigError, match="records of no user"):
        check(audit_config("audit.kind=input"))

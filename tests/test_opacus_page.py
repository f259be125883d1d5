"""docs/opacus.md, "Coming from Opacus": its loops run as the page prints them, at 1 epoch (25 steps) instead of
4. Opacus' make_private_with_epsilon loop and the dpmem.api loop each learn and spend at most the ε asked, at the
same sample rate and number of steps, and their σ (Opacus' PRV accountant, dpmem's PLD) agree within 2 %. The
page's own-module block is refused with batch norm and runs once Opacus' ModuleValidator.fix has replaced it."""

import re
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("opacus", reason="the dev extra: pip install -e '.[dev]'")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "opacus.md"
SIZE = "n, batch_size, physical_batch_size, epochs = 1500, 60, 32, 4"
PRINTED = re.compile(r"epsilon (\d+\.\d+) \(sigma (\d+\.\d+)\), held-out accuracy (\d+\.\d+)")


def block(marker: str) -> str:
    """The page's one python block that holds `marker`."""
    found = [b for b in re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S) if marker in b]
    assert len(found) == 1, (marker, len(found))
    return found[0]


def run(code: str, name: str) -> tuple[dict, list[str]]:
    """The block run as a module of its own (a class it defines pickles: ModuleValidator.fix deep-copies the model),
    its prints collected."""
    printed = []
    module = types.ModuleType(name)
    module.print = lambda *args: printed.append(" ".join(map(str, args)))
    sys.modules[name] = module
    try:
        exec(compile(code, str(PAGE), "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    return module.__dict__, printed


def one_epoch(code: str) -> str:
    assert code.count(SIZE) == 1, "the page's loop no longer sets its size on one line"
    return code.replace(SIZE, SIZE[:-1] + "1")


@pytest.mark.filterwarnings("ignore::UserWarning")  # Opacus: secure RNG off, full backward hooks, RDP's orders
def test_the_opacus_and_dpmem_loops_train_at_the_same_rate_and_steps_within_the_epsilon_asked():
    opacus_ns, opacus_out = run(one_epoch(block("make_private_with_epsilon")), "opacus_page_opacus")
    dpmem_ns, dpmem_out = run(one_epoch(block("poisson_batches(n, q, steps")), "opacus_page_dpmem")
    epsilon, steps, q = 8.0, 25, 60 / 1500

    # both print one line: ε, σ and the held-out accuracy; both learn (chance is 0.1)
    (o_eps, o_sigma, o_acc), = [PRINTED.fullmatch(line).groups() for line in opacus_out]
    (d_eps, d_sigma, d_acc), = [PRINTED.fullmatch(line).groups() for line in dpmem_out]
    assert float(o_acc) > 0.3 and float(d_acc) > 0.3, (opacus_out, dpmem_out)

    # Opacus: get_epsilon at most the target; its accountant composed 25 steps at rate 1/len(loader) = 0.04
    engine = opacus_ns["privacy_engine"]
    assert opacus_ns["spent"] == engine.get_epsilon(1e-5) <= epsilon and float(o_eps) <= epsilon
    (sigma_o, q_o, steps_o), = engine.accountant.history
    assert (q_o, steps_o) == (q, steps) and opacus_ns["loader"].sample_rate == q
    assert sigma_o == opacus_ns["optimizer"].noise_multiplier

    # dpmem: the printed ε at most the target, at the same q and steps, its σ near Opacus' (PLD against PRV)
    assert dpmem_ns["spent"] <= epsilon and float(d_eps) <= epsilon
    assert (dpmem_ns["q"], dpmem_ns["steps"]) == (q, steps)
    assert dpmem_ns["sigma"] == pytest.approx(sigma_o, rel=0.02)
    assert float(d_sigma) == pytest.approx(dpmem_ns["sigma"], abs=5e-4)


def test_the_one_call_loop_spends_what_the_long_one_does_and_learns():
    """make_private's block at 1 epoch: the rate, steps and σ of the long dpmem.api block (one calibration), ε at
    most the target, the accountant's ε of its steps, and it learns."""
    ns, printed = run(one_epoch(block("make_private(model, optimizer")), "opacus_page_one_call")
    (eps, sigma, acc), = [PRINTED.fullmatch(line).groups() for line in printed]
    private = ns["private"]
    assert (private.sample_rate, private.steps, private.taken) == (60 / 1500, 25, 25)
    from dpmem.api import calibrate_sigma, epsilon_spent
    assert private.sigma == calibrate_sigma(8.0, 1e-5, 60 / 1500, 25)
    assert private.epsilon == epsilon_spent(private.sigma, 1e-5, 60 / 1500, 25) <= 8.0 and float(eps) <= 8.0
    assert float(acc) > 0.3, printed


def test_the_own_module_block_is_refused_with_batch_norm_and_runs_once_fixed():
    ns, printed = run(block("ModuleValidator.fix"), "opacus_page_module")
    assert len(printed) == 1 and "BatchNorm1d mixes samples" in printed[0]
    assert type(ns["model"][1]).__name__ == "GroupNorm"
    scale = ns["model"][3].scale
    assert any(p is scale for p in ns["privatize"].params) and ns["grads"][scale].shape == scale.shape  # the replayed own layer

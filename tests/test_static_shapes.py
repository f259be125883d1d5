"""train.static_shapes: every micro-batch at the physical batch size, the short one padded with samples that weigh 0.
Padding changes no step (given the same noise), no run and no ε.

The models here have no dropout: padding samples would draw dropout masks and so shift the real samples' draws."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from dpmem.data import DataBundle
from dpmem.data.bundle import Padded, real_size, weights
from dpmem.engine.trainer import Run
from dpmem.methods import build_method, method_config
from dpmem.methods.base import batch_size
from dpmem.privacy.mechanism import GaussianMechanism
from helpers import PRIVATE, config, seeded
from tiny_models import tiny_vit

N, PHYSICAL = 7, 4  # micro-batches of 4 and 3 samples; under static shapes, 4 and 3 + 1 padding


def split(columns, physical, static, trim=False):
    """What the trainer's `Run.microbatches` makes of a logical batch that holds every example of `columns`."""
    n = len(next(iter(columns.values())))
    data = DataBundle(train=columns, test=columns, num_classes=0, input_shape=(), per_sample_loss=None,
                      predict=None, trim_padding=trim)
    run = SimpleNamespace(data=data, device=torch.device("cpu"), static_shapes=static, grouped=None,
                          cfg=OmegaConf.create({"train": {"batch_size": n, "physical_batch_size": physical,
                                                          "fsdp": False, "static_shapes": static}}))
    run._on_device = lambda index: Run._on_device(run, index)
    return Run.microbatches(run, torch.arange(n))


def vit_case():
    torch.manual_seed(0)
    model, loss, _ = tiny_vit(attn="eager")  # ViTConfig's dropout is 0
    g = torch.Generator().manual_seed(1)
    batch = {"pixel_values": torch.randn(N, 1, 8, 8, generator=g, dtype=torch.float64)
             * torch.linspace(0.2, 4, N, dtype=torch.float64).view(-1, 1, 1, 1),
             "labels": torch.randint(0, 4, (N,), generator=g)}
    return model.double(), loss, batch


METHODS = PRIVATE + [("dp-sgd", {"clipping": "bk"}), ("dpzero", {}), ("adam", {}), ("galore", {"rank": 4}),
                     ("mezo", {})]


def one_step(name, options, micro):
    """The parameters after one step of `name` on `micro`, and the step's summed loss."""
    model, loss, _ = vit_case()
    private = name not in ("adam", "galore", "mezo")
    cfg = method_config(name, **options, **({"max_grad_norm": 0.5} if private else {}))
    noise = GaussianMechanism(0.3, 0.5, float(N), seeded(7)) if private else None
    method = build_method(cfg, model, 0.05, noise)
    loss_sum = method.step(micro, loss)
    method.close()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), loss_sum.detach()


@pytest.mark.parametrize("name, options", METHODS, ids=lambda x: x if isinstance(x, str) else
                         "-".join(f"{k}={v}" for k, v in x.items()))
def test_a_padded_step_equals_the_unpadded_one(name, options):
    batch = vit_case()[2]
    plain, padded = split(batch, PHYSICAL, static=False), split(batch, PHYSICAL, static=True)
    assert [batch_size(mb) for mb in plain] == [4, 3] and [batch_size(mb) for mb in padded] == [4, 4]
    want, want_loss = one_step(name, options, plain)
    got, got_loss = one_step(name, options, padded)
    # float64 models; zeroth-order methods take their losses in float32, where a sum over 8 entries (one of them
    # padding's 0) rounds differently from one over 7
    zeroth = name in ("dpzero", "mezo")
    torch.testing.assert_close(got, want, rtol=1e-6 if zeroth else 1e-9, atol=1e-7 if zeroth else 1e-11)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6 if zeroth else 1e-12, atol=0.0)
    # the padding sample counted as a real one would change the step: the comparison above can fail
    counted, _ = one_step(name, options, [dict(mb) for mb in padded])
    assert not torch.allclose(counted, want, rtol=1e-6, atol=1e-8)


def test_static_shapes_pad_the_short_micro_batch_with_copies_that_weigh_0():
    columns = {"x": torch.arange(10.0).view(5, 2), "y": torch.arange(5)}
    micro = split(columns, 2, static=True)
    assert [batch_size(mb) for mb in micro] == [2, 2, 2] and [real_size(mb) for mb in micro] == [2, 2, 1]
    assert all(isinstance(mb, Padded) and set(mb) == {"x", "y"} for mb in micro)  # no extra column for the loss
    last = micro[-1]
    assert last["y"].tolist() == [4, 4] and last["x"].tolist() == [[8.0, 9.0], [8.0, 9.0]]
    assert weights(last).tolist() == [1.0, 0.0] and weights(micro[0]).tolist() == [1.0, 1.0]
    assert [batch_size(mb) for mb in split(columns, 2, static=False)] == [2, 2, 1]
    empty = {k: v[:0] for k, v in columns.items()}
    assert split(empty, 2, static=True) == []  # an empty Poisson batch: noise only, no micro-batch


def test_static_shapes_keep_the_full_token_width():
    ids = torch.tensor([[5, 6, 0, 0, 0], [5, 6, 7, 0, 0], [5, 0, 0, 0, 0]])
    columns = {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.arange(3)}
    trimmed = split(columns, 2, static=False, trim=True)
    assert [mb["input_ids"].shape[1] for mb in trimmed] == [3, 1]
    static = split(columns, 2, static=True, trim=True)
    assert [mb["input_ids"].shape for mb in static] == [(2, 5), (2, 5)]
    assert [mb["attention_mask"].shape[1] for mb in static] == [5, 5]


# non-private Adam with SGD's update: Adam's divides each gradient by its own size, and an attention key bias's
# gradient is 0 but for float32 rounding, which differs between batch shapes
@pytest.mark.parametrize("method", [["method=grape"], ["method=dp-adam", "method.clipping=ghost"],
                                    ["method=adam", "method.optimizer=sgd", "privacy=none"], ["method=dpzero"]])
def test_a_static_shape_run_trains_and_spends_as_the_plain_one(tmp_path, monkeypatch, method):
    sizes = []

    def spy(cls):
        step = cls.step

        def recording(self, micro, loss_fn):
            sizes.append([(batch_size(mb), real_size(mb)) for mb in micro])
            return step(self, micro, loss_fn)
        monkeypatch.setattr(cls, "step", recording)

    def run(static):
        cfg = config(*method, "train.device=cpu", "train.physical_batch_size=10", "privacy.sampler_seed=1",
                     "privacy.noise_seed=2", f"train.static_shapes={static}")
        (tmp_path / str(static)).mkdir()
        r = Run(cfg, tmp_path / str(static))
        r.prepare()
        spy(type(r.method))
        summary = r.execute()
        monkeypatch.undo()
        assert summary["status"] == "ok", summary["error"]
        return summary, torch.cat([p.detach().flatten() for p in r.model.parameters()]), r.mechanism

    plain, plain_params, plain_mechanism = run(False)
    plain_sizes, sizes[:] = list(sizes), []
    static, static_params, static_mechanism = run(True)
    assert [sum(r for _, r in step) for step in sizes] == [sum(b for b, _ in step) for step in plain_sizes]
    assert all(b == 10 for step in sizes for b, _ in step)  # every micro-batch at the physical size
    assert any(r < b for step in sizes for b, r in step)  # and some of them padded
    assert any(b < 10 for step in plain_sizes for b, _ in step)
    torch.testing.assert_close(static_params, plain_params, rtol=1e-5, atol=1e-6)
    assert static["train_loss"] == pytest.approx(plain["train_loss"], rel=1e-5)
    assert static["metric_final"] == plain["metric_final"]
    for key in ("epsilon_spent", "sample_rate", "sigma", "steps_done", "samples_seen"):  # the accountant's view
        assert static[key] == plain[key], key
    assert static_mechanism.expected_batch_size == plain_mechanism.expected_batch_size

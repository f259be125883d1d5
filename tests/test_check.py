"""dpmem.api.check: each parameter's rule, the attribution proof under every plan, each plan's step memory (the
live-tensor counter, exact on the CPU); refusals as the private step itself makes them."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmem import api


class Classifier(nn.Module):
    def __init__(self, norm=None):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(20, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 3)
        self.norm = norm or nn.Identity()

    def forward(self, ids):
        return self.head(self.norm(self.rnn(self.emb(ids))[0].mean(1)))


def batch():
    g = torch.Generator().manual_seed(0)
    return {"ids": torch.randint(0, 20, (4, 6), generator=g), "y": torch.randint(0, 3, (4,), generator=g)}


def loss(m, b):
    return F.cross_entropy(m(b["ids"]), b["y"], reduction="none")


def test_check_names_each_rule_proves_every_plan_and_measures_it_leaving_the_model_as_it_was():
    torch.manual_seed(0)
    model = Classifier()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    found = api.check(model, loss, batch())
    assert {n: how for n, how, _ in found.rules} == {
        "emb": "Embedding rule (factored)", "head": "Linear rule (factored)",
        "rnn": "LSTM replayed one sample at a time (dense)"}
    assert dict((n, c) for n, _, c in found.rules)["rnn"] == sum(p.numel() for p in model.rnn.parameters())
    assert set(found.plans) == {"materialize", "bk", "ghost", "mixed", "fgc"}
    # dense per-sample gradients of the head and embedding (materialize) hold more than their factors (bk)
    assert found.plans["materialize"]["per_sample"] > found.plans["bk"]["per_sample"] > 0
    assert "| rnn | LSTM replayed one sample at a time (dense) |" in str(found)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None, n


@pytest.mark.parametrize("norm, error, words", [
    (nn.BatchNorm1d(8), ValueError, r"norm: BatchNorm1d mixes samples"),
    (type("Centre", (nn.Module,), {"forward": lambda self, x: x - x.mean(0)})(), RuntimeError, r"norm mixes samples"),
])
def test_check_refuses_what_the_private_step_refuses(norm, error, words):
    with pytest.raises(error, match=words):
        api.check(Classifier(norm), loss, batch(), plans=["bk"])


def test_dpmem_check_builds_a_configuration_and_prints_each_rule_and_plan(cli):
    r = cli("check", "model=vit-tiny", "data=synthetic", "data.image_size=8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("dpmem check: vit-tiny on 4 samples of synthetic")
    assert "| vit.embeddings.patch_embeddings.projection | Conv2d rule (factored) |" in r.stdout
    assert all(f"| {plan} |" in r.stdout for plan in ("materialize", "bk", "ghost", "mixed", "fgc"))
    from dpmem.api import config, plan
    planned = plan(config("model=vit-tiny", "data=synthetic", "data.image_size=8"))["peak_bytes"]
    assert f"as dpmem memory plans it: peak {planned / 2**30:.3f} GiB (training " in r.stdout, r.stdout[-500:]


def test_dpmem_check_refuses_a_checkpoint_with_batch_norm_in_one_line_naming_the_layer(cli, tmp_path):
    """A ResNet from the hub (model=auto): its batch norms mix samples, the line names the first and the fix."""
    import transformers as tf
    tf.ResNetModel(tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8], depths=[1],
                                   layer_type="basic")).save_pretrained(tmp_path / "resnet")
    r = cli("check", "model=auto", f"model.pretrained={tmp_path / 'resnet'}", "data=synthetic", "data.image_size=8")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    line = next(x for x in r.stderr.splitlines() if x.startswith("dpmem: error:"))
    assert "check: auto: " in line and "BatchNorm2d mixes samples" in line and "GroupNorm" in line, line

"""Embedding per-sample gradients without the (B, vocab, D) tensor: norms and clipped sums equal the dense ones."""

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch import nn

from dpmem.composition import CONF_DIR
from dpmem.data import build_data, example_batch
from dpmem.metering import LiveTensorCounter
from dpmem.methods import DPAdam, build_method, method_config
from dpmem.models import build_model
from dpmem.persample import Taps, clip_factors, per_sample_norms, reducers, weighted_sum
from dpmem.persample.factored import Factored
from dpmem.privacy.mechanism import GaussianMechanism
from helpers import LargestTensor, seeded


def test_factored_rows_match_their_dense_form():
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[3, 3, 0, 7], [1, 2, 1, 1], [5, 5, 5, 5]])  # repeated rows within a sample
    rows = Factored.outer(ids, torch.randn(3, 4, 6, generator=g, dtype=torch.float64), rows=9)
    dense = rows.to_dense()
    torch.testing.assert_close(rows.squared_norms(), dense.pow(2).sum((1, 2)))
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(rows.weighted_sum(w), torch.einsum("b,bvd->vd", w, dense))
    both = rows + rows
    torch.testing.assert_close(both.to_dense(), 2 * dense)
    torch.testing.assert_close(rows + dense, 2 * dense)  # with a dense part it densifies


class LM(nn.Module):
    def __init__(self, tied: bool, vocab=30, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.mix(self.emb(ids)).tanh())


def lm_loss(model, b):
    logits = model(b["ids"])
    return F.cross_entropy(logits.transpose(1, 2), b["labels"], reduction="none").sum(1)


def make_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 6, (5, 7), generator=g)  # a small id range: many repeats
    ids[0, 4:] = 0
    return {"ids": ids, "labels": torch.randint(0, 30, (5, 7), generator=g)}


def dense_oracle(model, b):
    """One backward per sample: dense per-sample gradients of every parameter."""
    per = {p: [] for p in model.parameters()}
    for i in range(5):
        model.zero_grad(set_to_none=True)
        lm_loss(model, {k: v[i:i + 1] for k, v in b.items()}).sum().backward()
        for p in model.parameters():
            per[p].append(p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {p: torch.stack(g) for p, g in per.items()}


def test_norms_and_clipped_sums_equal_dense_for_untied_and_tied_embeddings():
    for tied in (False, True):
        torch.manual_seed(0)
        model, b = LM(tied).double(), make_batch()
        grads = Taps(model).gradients(lambda: lm_loss(model, b).sum(), 5)
        assert isinstance(grads[model.emb.weight], Factored)  # tied: the head's use joins as factors
        want = dense_oracle(model, b)
        norms = per_sample_norms(grads)
        want_norms = torch.stack([g.reshape(5, -1).pow(2).sum(1) for g in want.values()]).sum(0).sqrt()
        torch.testing.assert_close(norms, want_norms)
        factors = clip_factors(norms, float(norms.median()))
        got = weighted_sum(grads, factors)
        for p, g in want.items():
            torch.testing.assert_close(got[p], torch.einsum("b,b...->...", factors, g))


def test_no_batch_by_vocab_tensor_is_made():
    vocab, dim, batch = 20000, 8, 16

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.head = nn.Linear(dim, 3)

        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    model = Bag()
    cfg = method_config("dp-adam", optimizer="sgd", max_grad_norm=1.0, check_coverage=False)
    method = DPAdam(model, cfg, 0.1, GaussianMechanism(1.0, 1.0, float(batch), None))
    b = {"ids": torch.randint(0, vocab, (batch, 12)), "y": torch.randint(0, 3, (batch,))}
    loss = lambda m, x: F.cross_entropy(m(x["ids"]), x["y"], reduction="none")  # noqa: E731
    with LiveTensorCounter().track_state(model, method) as counter:
        method.step([b], loss)
    dense_per_sample = batch * vocab * dim * 4
    # weights, summed gradient, noise and update are a few vocab×dim matrices; B×vocab×dim would be 16 of them
    assert counter.peak < dense_per_sample / 2, (counter.peak, dense_per_sample)


def test_projected_embeddings_equal_dense_gradients_times_p_with_tied_head():
    """method.project_embeddings: embedding (and tied LM-head) gradients projected along the hidden dimension."""
    from dpmem.methods.projected_adam import choose_projected
    from dpmem.persample import Projection
    for tied in (False, True):
        torch.manual_seed(0)
        model, b = LM(tied).double(), make_batch()
        sides = choose_projected(model, None, 2, embeddings=True)
        assert sides[model.emb.weight] == 1 and sides[model.head.weight] == 1  # hidden side for both
        P = torch.randn(6, 2, dtype=torch.float64)
        kept = Taps(model).gradients(lambda: lm_loss(model, b).sum(), 5,
                                     {model.emb.weight: reducers.projected(lambda: Projection(P, 1))})
        got = kept[model.emb.weight]
        got = got.to_dense() if isinstance(got, Factored) else got
        want = dense_oracle(model, b)[model.emb.weight] @ P
        torch.testing.assert_close(got, want)


TIED_CASES = [("dp-adam", {}), ("dp-adam", {"clipping": "bk"}), ("dp-adam", {"clipping": "ghost"}), ("dp-adam", {"clipping": "mixed"}),
              ("dp-sgd-rc", {"estimator": "hutch", "k": 4}), ("dp-sgd-rc", {"estimator": "hutchpp", "k": 4}),
              ("galore-dp-naive", {"rank": 4}), ("grape", {"rank": 4}),
              ("grape", {"rank": 4, "project_embeddings": True})]


@pytest.mark.parametrize("model", ["roberta-tiny-mlm", "opt-tiny"])
@pytest.mark.parametrize("method,options", TIED_CASES, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k}={v}" for k, v in x.items()))
def test_a_tied_lm_head_never_makes_a_batch_by_vocab_by_hidden_tensor(model, method, options):
    """The head's uses stay factored beside the embedding's rows through norms and clipped sums, in every
    clipping mode (the probes of hutch/hutch++ are B×vocab×k, k < hidden here)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["data=synthetic", "data.seq_len=12", "data.n_train=16",
                                           *(["model=roberta-tiny", "model.head=mlm"] if model == "roberta-tiny-mlm"
                                             else ["model=opt-tiny"])])
    data = build_data(cfg.data, cfg.model)
    torch.manual_seed(0)
    net = build_model(cfg.model, data).train()
    head, emb = net.get_output_embeddings(), net.get_input_embeddings()
    assert head.weight is emb.weight  # tied
    vocab, hidden = emb.weight.shape
    batch = 4
    step = build_method(method_config(method, max_grad_norm=1.0, **options), net, 0.01,
                        GaussianMechanism(1.0, 1.0, float(batch), seeded(0)))
    micro = [example_batch(data, batch, "cpu")]
    with LargestTensor() as largest:
        for _ in range(2):  # the coverage check's step, then a plain one
            step.step(micro, data.per_sample_loss)
    assert largest.numel < batch * vocab * hidden / 2, (largest.numel, batch * vocab * hidden)

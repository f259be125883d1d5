"""model=auto: a Hugging Face checkpoint of any type, built from its own config.json by the Auto class of its head,
trained privately by `dpmem train` (the attribution proof on its first step), planned on the meta device without
weights; a checkpoint loaded into a family it is not, or whose weights leave base-model parameters missing, refused
in one line. The checkpoints are tiny random-init ones saved here, offline."""

import json
import re

import pytest
import torch

SMALL = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=60,
             max_position_embeddings=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A folder per model type: config.json and weights, as save_pretrained writes them (a base model, or an LM)."""
    import transformers as tf
    root = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    made = {
        # GPT-2 with no padding id (its classifier needs one: dpmem takes the end-of-text id)
        "gpt2": tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=60, n_positions=64, n_embd=16, n_layer=1, n_head=2,
                                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                                 eos_token_id=0)),
        "bert": tf.BertModel(tf.BertConfig(**SMALL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        "qwen2": tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL, num_key_value_heads=1)),
        "vit": tf.ViTModel(tf.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                                        num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)),
        # a classifier fine-tuned on 7 classes: its head is of another size than the data's, and is new
        "vit-7-classes": tf.ViTForImageClassification(tf.ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, num_labels=7)),
    }
    for name, model in made.items():
        model.save_pretrained(root / name)
    return root


RUN = ["method=dp-adam", "data=synthetic", "data.n_train=32", "data.seq_len=16", "train.steps=2",
       "train.batch_size=8", "train.device=cpu", "logging.progress=false", "privacy=eps8"]


@pytest.mark.parametrize("name, head", [("gpt2", "classifier"), ("bert", "classifier"), ("qwen2", "causal"),
                                        ("vit", "classifier"), ("vit-7-classes", "classifier")])
def test_a_checkpoint_of_any_type_trains_privately_from_its_own_config(cli, checkpoints, name, head):
    r = cli("train", "model=auto", f"model.pretrained={checkpoints / name}", f"model.head={head}", *RUN,
            "hydra.run.dir=run")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads(open("run/summary.json").read())
    assert summary["status"] == "ok" and 0 < summary["epsilon_spent"] <= 8.0 * 1.001


def test_dpmem_memory_plans_a_checkpoint_from_its_config_on_the_meta_device(cli, checkpoints):
    r = cli("memory", "model=auto", f"model.pretrained={checkpoints / 'qwen2'}", "model.head=causal",
            "method=dp-adam", "data=synthetic", "data.seq_len=16", "train.batch_size=8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| dp-adam | 8 |" in r.stdout


@pytest.mark.parametrize("overrides, words", [
    (["model=roberta-tiny", "model.pretrained={gpt2}"], r"model\.pretrained: .* is a gpt2 checkpoint, not roberta "
                                                          r".*model=auto model\.pretrained="),
    (["model=auto", "model.pretrained={gpt2}", "+model.arch.n_layer=2"],
     r"leaves 12 of the base model's parameters without weights \(e\.g\. transformer\.h\.1\."),
    (["model=auto", "model.pretrained={gpt2}", "data.seq_len=128"], r"data\.seq_len: 128 tokens exceed the 64 "
                                                                     r"positions"),
    (["model=auto", "model.pretrained={vit}", "model.head=causal"], r"model\.head: an image checkpoint \(vit\)"),
    (["model=auto"], r"model\.pretrained: model=auto builds a checkpoint's architecture"),
])
def test_a_checkpoint_that_does_not_fit_is_refused_in_one_line(cli, checkpoints, overrides, words):
    over = [o.format(gpt2=checkpoints / "gpt2", vit=checkpoints / "vit") for o in overrides]
    r = cli("train", *over, *[o for o in RUN if not o.startswith("data.seq_len") or "data.seq_len=128" not in over])
    assert r.returncode == 2, r.stderr[-2000:]
    line = next(x for x in r.stderr.splitlines() if x.startswith("dpmem: error:"))

    assert re.search(words, line), line


def test_lora_on_any_checkpoint_targets_its_linear_layers_by_type_and_trains_its_head(checkpoints):
    """GPT-2's layers are transformers' Conv1D, named c_attn, c_proj, c_fc: found by type, as is its head (`score`,
    not `classifier`), trained in full."""
    from types import SimpleNamespace

    from dpmem.models import build_model
    from helpers import config
    cfg = config("model=auto", f"model.pretrained={checkpoints / 'gpt2'}", "model.lora.r=2")
    model = build_model(cfg.model, SimpleNamespace(input_shape=(16,), num_classes=2))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    adapted = {n.split(".lora_")[0] for n in trainable if ".lora_" in n}
    assert adapted == {f"transformer.h.0.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert {n for n in trainable if ".lora_" not in n} == {"score.weight"}

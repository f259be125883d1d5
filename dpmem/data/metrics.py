"""The papers' text metrics in one place: SQuAD's F1 and exact match (QA: SQuAD, DROP, HotpotQA), ROUGE-1
(summarisation: BillSum, through Google's `rouge-score` package). Accuracy is dpmem.engine.trainer.evaluate's."""

from __future__ import annotations

import collections
import re
import string
from typing import Sequence


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles (a, an, the), single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1 if the normalised prediction equals any normalised gold answer."""
    return float(any(normalize_answer(prediction) == normalize_answer(a) for a in answers))


def f1(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD's token F1 against the best-matching gold answer."""
    return max((_token_f1(prediction, a) for a in answers), default=0.0)


def _token_f1(prediction: str, answer: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
    if not pred or not gold:
        return float(pred == gold)
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def rouge1(prediction: str, answers: Sequence[str]) -> float:
    """ROUGE-1 F-measure (Porter stemming, as in the summarisation literature) against the best reference."""
    from rouge_score import rouge_scorer
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    return max((scorer.score(a, prediction)["rouge1"].fmeasure for a in answers), default=0.0)


def mean_text_metric(name: str, predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """A data set's score: the mean of a per-example text metric (f1, exact_match, rouge1) over its examples."""
    fn = {"f1": f1, "exact_match": exact_match, "rouge1": rouge1}[name]
    return sum(fn(p, a) for p, a in zip(predictions, answers, strict=True)) / max(len(answers), 1)

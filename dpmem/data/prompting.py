"""Records to token-id columns: which examples are used (k-shot per class, dev, test), how a template becomes
ids, and how the evaluation split is scored.

Templates are format strings over a record's fields, with `{mask}` (the masked-LM head's slot) and `{sep}` (the
tokenizer's separator). As in LM-BFF, each piece is tokenised on its own and the pieces are concatenated, so the
template's text is never merged with a sentence's tokens and truncation (longest field first) never cuts the
template. A literal's trailing space goes with the field after it (`" {sentence}"` → "Ġword" tokens). Field
modifiers: `{premise:drop_last}` drops the final character (LM-BFF's `sent-`), `{hypothesis:lower_first}`
lower-cases the first (`sentl`). Label words are read as " word" (a leading space), their first token."""

from __future__ import annotations

import string
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from dpmem.config import ConfigError
from dpmem.data import text
from dpmem.data.bundle import DataBundle
from dpmem.data.metrics import mean_text_metric
from dpmem.sources import fetching, resolve_source, why_not_loaded
from dpmem.sources import offline as downloads_off

MODIFIERS = {"": lambda s: s, "drop_last": lambda s: s[:-1], "lower_first": lambda s: s[:1].lower() + s[1:]}


def load_tokenizer(model_cfg):
    from transformers import AutoTokenizer
    name = model_cfg.tokenizer or model_cfg.pretrained
    if not name:
        raise ConfigError("model.tokenizer", f"{model_cfg.name} has no tokenizer for text data: set model.tokenizer "
                          "to a hub id or a local folder (e.g. FacebookAI/roberta-large)")
    offline = downloads_off()
    source = resolve_source(name, "model.tokenizer")
    unreachable = None if offline or Path(source).exists() else fetching(f"the tokenizer {name}")
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=offline or unreachable is not None)
    except (OSError, ValueError) as e:
        hint = " (offline: only the local cache is searched)" if offline else ""
        raise ConfigError("model.tokenizer", f"cannot load the tokenizer {name!r}{hint}: "
                          f"{why_not_loaded(unreachable, e)}; run once with network access or give a local folder") \
            from None


class Encoder:
    """A tokenizer's view of templates: the special-token frame around a text, and pieces to ids."""

    def __init__(self, tokenizer, head: str, max_length: int):
        self.tok, self.head, self.max_length = tokenizer, head, max_length
        probe = tokenizer("a")["input_ids"]
        inner = tokenizer("a", add_special_tokens=False)["input_ids"]
        start = next(i for i in range(len(probe)) if probe[i:i + len(inner)] == inner)
        self.prefix, self.suffix = probe[:start], probe[start + len(inner):]
        if head == "causal":
            self.suffix = []  # the class or the answer follows the prompt's last token
        self.pad = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)

    def ids(self, text_: str) -> list[int]:
        return self.tok(text_, add_special_tokens=False)["input_ids"] if text_ else []

    def pieces(self, template: str, record: dict) -> tuple[list[list[int]], list[int]]:
        """The template's ids piece by piece (its literal text, special tokens and fields), and which pieces are
        fields (the ones truncation shortens)."""
        pieces, fields = [], []
        for literal, name, spec, _ in string.Formatter().parse(template):
            if name in ("mask", "sep"):
                token = self.tok.mask_token_id if name == "mask" else self.tok.sep_token_id
                if token is None:
                    raise ConfigError("data.template", f"{{{name}}}: this tokenizer has no {name} token")
                pieces.append(self.ids(literal) + [token])
                continue
            text_ = literal.rstrip() if name else literal  # its trailing space goes with the field
            pieces.append(self.ids(text_))
            if name is None:
                continue
            if name not in record:
                raise ConfigError("data.template", f"{{{name}}} is not a field of this data set; it has "
                                  f"{', '.join(k for k in record if k not in ('label', 'answers'))}")
            if spec not in MODIFIERS:
                raise ConfigError("data.template", f"{{{name}:{spec}}}: allowed modifiers "
                                  f"{', '.join(m for m in MODIFIERS if m)}")
            fields.append(len(pieces))
            pieces.append(self.ids(literal[len(text_):] + MODIFIERS[spec](str(record[name]).strip())))
        return pieces, fields

    def encode(self, template: str, record: dict, reserve: int = 0) -> list[int]:
        """prefix + the template's ids + suffix, fields truncated (longest first) to fit max_length − reserve."""
        pieces, fields = self.pieces(template, record)
        overflow = len(self.prefix) + len(self.suffix) + reserve + sum(map(len, pieces)) - self.max_length
        while overflow > 0:
            i = max(fields, key=lambda j: len(pieces[j]), default=None)
            if i is None or len(pieces[i]) <= 1:
                raise ConfigError("data.max_length", f"{self.max_length} tokens cannot hold this template")
            cut = min(overflow, len(pieces[i]) - 1)
            pieces[i] = pieces[i][:-cut]
            overflow -= cut
        return self.prefix + [t for piece in pieces for t in piece] + self.suffix

    def label_word_ids(self, words: list[str]) -> list[int]:
        ids = [self.ids(" " + w)[0] for w in words]
        if len(set(ids)) != len(ids):
            raise ConfigError("data.label_words", f"{words} share a first token; give words that differ")
        return ids


def bundle(cfg, model_cfg, task, train_records: list[dict], test_records: Optional[list[dict]]) -> DataBundle:
    head = model_cfg.head
    generative = task.target is not None
    if head == "classifier" and not task.classifier_ok:
        raise ConfigError("model.head", f"data={cfg.name} is a generation task: it needs a causal LM (e.g. "
                          "model=opt-1.3b)")
    template = cfg.template or task.templates.get(head)
    if not cfg.template and head == "classifier" and cfg.name in ("csv", "jsonl") and cfg.columns.get("text_pair"):
        template = "{text}{sep}{text_pair}"  # a pair file's classifier reads both texts
    if template is None:
        raise ConfigError("data.template", f"data={cfg.name} has no prompt for a {head} head (it has: "
                          f"{', '.join(task.templates)}); set data.template (and data.label_words)")
    tokenizer = load_tokenizer(model_cfg)
    vocab = model_cfg.arch.get("vocab_size") if not model_cfg.pretrained else None
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError("model.arch.vocab_size", f"{vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    enc = Encoder(tokenizer, head, cfg.max_length)
    train, dev, test = choose(cfg, train_records, test_records, stratify=not generative)
    evaluated = {"test": test, "dev": dev}[cfg.eval_split] if cfg.eval_split in ("test", "dev") else None
    if evaluated is None:
        raise ConfigError("data.eval_split", f"{cfg.eval_split!r}: allowed test, dev")
    if not evaluated:
        raise ConfigError("data.eval_split", "dev is empty: set data.n_dev (per class with data.k)")
    pad_to = cfg.max_length if task.fixed_length else None
    if generative:
        return _generation(cfg, task, enc, template, train, evaluated, pad_to)
    words = cfg.label_words or task.label_words or _names(train_records)
    if words is None and head != "classifier":
        raise ConfigError("data.label_words", f"a {head} head reads classes as label words: set data.label_words")
    classes = len(words) if words else 1 + max(r["label"] for r in train_records)
    if any(not 0 <= r["label"] < classes for r in train + evaluated):
        raise ConfigError("data.label_words", f"{classes} label words for labels outside 0..{classes - 1}")
    word_ids = enc.label_word_ids(list(words)) if head in ("mlm", "causal") else []
    if head == "mlm" and "{mask}" not in template:
        raise ConfigError("data.template", "a masked-LM head reads the class at {mask}; the template has none")
    columns = [_classification(enc, template, split, pad_to) for split in (train, evaluated)]
    loss, predict = text.task(head, word_ids)
    return DataBundle(columns[0], columns[1], classes, tuple(columns[0]["input_ids"].shape[1:]), loss, predict,
                      trim_padding=not task.fixed_length, users=_users(train))


def _users(train: list[dict]) -> Optional[torch.Tensor]:
    """The training records' user ids (`dpmem.data.users.ids_of`) where the records name their user (a file's
    data.columns.user), else None."""
    if not train or "user" not in train[0]:
        return None
    from dpmem.data.users import ids_of
    return ids_of(r["user"] for r in train)


def _names(records_: list[dict]) -> Optional[list[str]]:
    """The classes' names as the data gives them (label_name), in label order; None if it gives none."""
    names = {r["label"]: r["label_name"] for r in records_ if "label_name" in r}
    if not names:
        return None
    missing = [i for i in range(max(names) + 1) if i not in names]
    if missing:
        raise ConfigError("data.label_words", f"no example names class(es) {missing}: set data.label_words")
    return [names[i] for i in range(max(names) + 1)]


def choose(cfg, train: list[dict], test: Optional[list[dict]], stratify: bool):
    """(train, dev, test) records. Without a test split, `test_fraction` of train is held out with `split_seed`.
    Train (k per class, or n_train in all) and dev (n_dev, per class with k) are disjoint draws with
    `fewshot_seed`; the test set is n_test examples drawn with `split_seed`."""
    if test is None:
        order = np.random.default_rng(cfg.split_seed).permutation(len(train))
        cut = round(len(train) * cfg.test_fraction)
        test, train = [train[i] for i in order[:cut]], [train[i] for i in order[cut:]]
    order = np.random.default_rng(cfg.fewshot_seed).permutation(len(train))
    if cfg.k is not None:
        if not stratify:
            raise ConfigError("data.k", "k examples per class is for classification; use data.n_train")
        chosen, dev, short = [], [], []
        for c in sorted({r["label"] for r in train}):
            of_c = [i for i in order if train[i]["label"] == c]
            if len(of_c) < cfg.k + (cfg.n_dev or 0):
                short.append(f"class {c}: {len(of_c)}")
            # a class smaller than k gives all it has, as LM-BFF's k-shot sampler (and so MeZO's TREC) does
            chosen += of_c[:cfg.k]
            dev += of_c[cfg.k:cfg.k + (cfg.n_dev or 0)]
        if short:
            print(f"dpmem: data.k={cfg.k}{f' + n_dev={cfg.n_dev}' if cfg.n_dev else ''} per class, but only "
                  f"{', '.join(short)} training examples: all of them are used", file=sys.stderr)
        chosen, dev = sorted(chosen), sorted(dev)  # the data set's order, not class blocks
    else:
        n = len(order) if cfg.n_train is None else min(cfg.n_train, len(order))
        chosen, dev = sorted(order[:n]), sorted(order[n:n + (cfg.n_dev or 0)])
    if cfg.n_test is not None and len(test) > cfg.n_test:
        keep = np.sort(np.random.default_rng(cfg.split_seed).choice(len(test), cfg.n_test, replace=False))
        test = [test[i] for i in keep]
    return [train[i] for i in chosen], [train[i] for i in dev], test


def _pad(rows: list[list[int]], value: int, length: Optional[int] = None, left: bool = False):
    width = length or max(len(r) for r in rows)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, span], mask[i, span] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask


def _classification(enc: Encoder, template: str, records_: list[dict], pad_to: Optional[int]) -> dict:
    """input_ids, attention_mask, labels and mask_pos: where the class is read (the mask, or for a causal LM the
    prompt's last token)."""
    rows = [enc.encode(template, r) for r in records_]
    pos = [r.index(enc.tok.mask_token_id) if enc.head == "mlm" else len(r) - 1 for r in rows]
    ids, attention = _pad(rows, enc.pad, pad_to)
    return {"input_ids": ids, "attention_mask": attention, "labels": torch.tensor([r["label"] for r in records_]),
            "mask_pos": torch.tensor(pos)}


def _generation(cfg, task, enc: Encoder, template: str, train: list[dict], evaluated: list[dict],
                pad_to: Optional[int]) -> DataBundle:
    """Train on prompt + answer (+ eos, so greedy decoding learns to stop), the loss on the answer's tokens only;
    evaluate greedy generations of up to max_new_tokens against every gold answer."""
    eos = enc.tok.eos_token_id
    rows, targets = [], []
    for r in train:
        answer = enc.ids(task.target.format(answer=str(r["answers"][0]).strip()))
        answer = (answer + ([eos] if eos is not None else []))[:cfg.max_new_tokens]
        prompt = enc.encode(template, r, reserve=len(answer))
        rows.append(prompt + answer)
        targets.append([0] * len(prompt) + [1] * len(answer))
    ids, attention = _pad(rows, enc.pad, pad_to)
    target_mask, _ = _pad(targets, 0, ids.shape[1])
    train_columns = {"input_ids": ids, "attention_mask": attention, "target_mask": target_mask}
    prompts = [enc.encode(template, r, reserve=cfg.max_new_tokens) for r in evaluated]
    test_ids, test_mask = _pad(prompts, enc.pad, left=True)  # left padding: generation continues every row
    test_columns = {"input_ids": test_ids, "attention_mask": test_mask, "index": torch.arange(len(evaluated))}
    answers = [list(map(str, r["answers"])) for r in evaluated]
    loss, _ = text.task("causal", [], generative=True)

    def generate(model, batch, **options):
        return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              max_new_tokens=cfg.max_new_tokens, do_sample=False, pad_token_id=enc.pad,
                              eos_token_id=eos, **options)

    @torch.no_grad()
    def score(model, device, batch_size: int, autocast) -> float:
        predictions = []
        for start in range(0, len(evaluated), batch_size):
            batch = {k: v[start:start + batch_size].to(device) for k, v in test_columns.items()}
            with autocast():
                out = generate(model, batch)
            new = out[:, batch["input_ids"].shape[1]:]
            predictions += [t.split("\n")[0].strip() for t in enc.tok.batch_decode(new, skip_special_tokens=True)]
        return mean_text_metric(task.metric, predictions, answers)

    def no_classes(model, batch):
        raise ConfigError("data.name", "a generation task has no class predictions")

    return DataBundle(train_columns, test_columns, 0, tuple(ids.shape[1:]), loss, no_classes,
                      metric_name=task.metric, score=score, generate=generate, trim_padding=not task.fixed_length)

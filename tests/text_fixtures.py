"""Offline stand-ins for hub downloads: byte-level BPE tokenizers trained on a small corpus (RoBERTa-style with
<s> … </s> and <mask>; GPT-style with a leading </s> as OPT's), and local copies of the tasks' hub splits."""

import json
from pathlib import Path

WORDS = ("a gripping film it was great terrible bad okay good the movie is dull and long but funny what who where "
         "when how many people live in paris city river question answer passage context title yes no maybe "
         "description entity expression human location number article topic bill summary tech sport").split()


def corpus() -> list[str]:
    return [" ".join(WORDS[i:i + 7]) for i in range(len(WORDS))] + [f"so {w.capitalize()}" for w in WORDS] + [
        "It was great.", "It was terrible.", "Title: Context: Question: Answer: Passage: Article: Topic: Bill: "
        "Summary:", "? , . ! :"]


def make_tokenizer(folder: Path, style: str) -> Path:
    """style roberta: <s> text </s> with <mask>; style opt: </s> text (OPT prepends its bos, id 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors, trainers
    from transformers import PreTrainedTokenizerFast
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=900, special_tokens=specials,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if style == "roberta":
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                       cls_token="<s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    else:
        tok.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 2)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>",
                                       unk_token="<unk>")
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return folder


def write_split(folder: Path, split: str, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{split}.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")

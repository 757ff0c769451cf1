"""The docstring-to-code demo's model and data, from the Python standard library every Python ships.

    python examples/docstrings.py model configs/llama_docstrings   # config.json + BPE tokenizer
    python examples/docstrings.py data runs/docstrings             # corpus.jsonl, pairs.jsonl

``model`` writes a small Llama-architecture Hugging Face directory without weights (jzero trains
it from scratch): config.json and a byte-level BPE tokenizer trained by ``tokenizers`` on the
standard library's sources, with ``<|endoftext|>`` as EOS and a ChatML chat template. It is
checked in under configs/, so the demo needs only ``data``.

``data`` writes, from the standard library's ``.py`` files (sorted by path; the held-out files
are every tenth):

* ``corpus.jsonl``: ``{"text": source}`` of every file but the held-out ones (pretraining);
* ``pairs.jsonl``: one conversational prompt/completion a function that has a docstring: the
  user's message is the function's signature and docstring, the assistant's its body. The
  held-out files' functions come last, and ``heldout_fraction`` (printed) cuts exactly there,
  so no held-out function's code was seen in pretraining or fine-tuning;
* ``heldout.jsonl``: the held-out pairs alone (for ``jzero eval``).

docs/finetune.md walks through the demo; benchmarks/finetune_demo.py runs and measures it.
"""
from __future__ import annotations

import ast
import json
import sys
import sysconfig
import textwrap
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 2048
MAX_BODY_CHARS, MAX_PROMPT_CHARS = 600, 500
HELDOUT_EVERY = 10


def sources() -> list[tuple[Path, str]]:
    """The standard library's top-level and package ``.py`` files (tests and site-packages
    left out), sorted by path, as text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))
             if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts]
    return [(p, p.read_text(encoding="utf-8", errors="replace")) for p in files]


def pairs(source: str) -> list[tuple[str, str]]:
    """(signature and docstring, body) of each function with a docstring and a short body,
    dedented to column 0."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines, out = source.splitlines(), []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        doc, rest = node.body[0], node.body[1:]
        if not rest or node.decorator_list:
            continue
        head = textwrap.dedent("\n".join(lines[node.lineno - 1:doc.end_lineno]))
        whole = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        body = whole[len(head):].lstrip("\n")
        if body.strip() and len(body) <= MAX_BODY_CHARS and len(head) <= MAX_PROMPT_CHARS:
            out.append((head, body))
    return out


def write_model(out: Path) -> None:
    """config.json (Llama, no weights) and the BPE tokenizer with its ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((text for _, text in sources()), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIALS[0], "chat_template": CHATML},
                                                          indent=2) + "\n")
    eos = tok.token_to_id(SPECIALS[0])
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 6,
              "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "hidden_act": "silu",
              "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "bos_token_id": None,
              "eos_token_id": [eos, tok.token_to_id(SPECIALS[2])], "pad_token_id": None, "dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out}: Llama config (no weights) and a {VOCAB}-token BPE tokenizer")


def write_data(out: Path) -> dict:
    """corpus.jsonl and pairs.jsonl (module docstring); returns their counts and the held-out
    fraction that cuts pairs.jsonl at the held-out files."""
    out.mkdir(parents=True, exist_ok=True)
    train_pairs, heldout_pairs, corpus = [], [], []
    for i, (_, text) in enumerate(sources()):
        heldout = i % HELDOUT_EVERY == HELDOUT_EVERY - 1
        (heldout_pairs if heldout else train_pairs).extend(pairs(text))
        if not heldout:
            corpus.append(text)
    with open(out / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in corpus)
    def record(head: str, body: str) -> str:
        return json.dumps({"prompt": [{"role": "user", "content": head}],
                           "completion": [{"role": "assistant", "content": body}]}) + "\n"

    with open(out / "pairs.jsonl", "w") as f:
        f.writelines(record(*pair) for pair in train_pairs + heldout_pairs)
    with open(out / "heldout.jsonl", "w") as f:
        f.writelines(record(*pair) for pair in heldout_pairs)
    fraction = len(heldout_pairs) / (len(train_pairs) + len(heldout_pairs))
    return {"corpus_files": len(corpus), "train_pairs": len(train_pairs), "heldout_pairs": len(heldout_pairs),
            "heldout_fraction": fraction}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("model", "data"):
        sys.exit(__doc__)
    if sys.argv[1] == "model":
        write_model(Path(sys.argv[2]))
    else:
        print(json.dumps(write_data(Path(sys.argv[2]))))

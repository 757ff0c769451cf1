"""A small Hugging Face-format Llama to try jzero's Hugging Face path offline (docs/hf.md).

    python examples/hf_tiny_llama.py OUT

writes OUT/model: random weights saved by transformers (config.json, safetensors shards and
their index), a byte-level BPE tokenizer trained on the Python standard library's sources
(tokenizer.json, with <|endoftext|> as EOS and a ChatML chat template), and OUT/data.jsonl,
one {"text": ...} document a line. Needs `pip install -e '.[hf]'` (transformers, torch, tokenizers).
"""
from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def stdlib_texts(count: int, start: str = "a") -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob(f"[{start}-z]*.py"))[:count]]


def write_tokenizer(out: Path, vocab_size: int, extra_texts: list[str] = ()) -> int:
    """A byte-level BPE tokenizer of ``vocab_size`` ids (`SPECIALS` first: EOS is id 0) with its
    config and chat template; returns the EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(stdlib_texts(20) + list(extra_texts), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIALS[0], "chat_template": CHATML}))
    return tok.token_to_id(SPECIALS[0])


def main(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 512
    eos = write_tokenizer(out / "model", vocab)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(out / "model", max_shard_size="200KB")
    docs = stdlib_texts(40, start="m")
    (out / "data.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n")
    print(f"wrote {out / 'model'} (Llama, {sum(p.numel() for p in LlamaForCausalLM(config).parameters()):,} params) "
          f"and {out / 'data.jsonl'} ({len(docs)} documents)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "hf_tiny"))

"""Build a small random-weight Llama model and a locally trained byte-level BPE tokenizer, with no hub access.

Usage: python make_tiny_model.py OUT HIDDEN LAYERS HEADS INTERMEDIATE
  tiny:  python make_tiny_model.py models/tiny-llama 64 2 2 128          (~0.6 M params, 1.5 MB, ~4 s)
  small: python make_tiny_model.py models/small-llama 1024 12 16 2816    (~162 M params, 311 MB, ~10 s)
Output text is gibberish (random weights); that does not matter for routing and caching.
"""

import glob
import json
import os
import sys
import sysconfig

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1]
hidden = int(sys.argv[2])
layers = int(sys.argv[3])
heads = int(sys.argv[4])
inter = int(sys.argv[5])
os.makedirs(out, exist_ok=True)

# 1) tokenizer: byte-level BPE trained on the Python stdlib sources (local text)
files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:200]
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|user|>", "<|assistant|>", "<|system|>"]
trainer = trainers.BpeTrainer(
    vocab_size=4096, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
)
tok.train(files, trainer)
bos = tok.token_to_id("<|begin_of_text|>")
tok.post_processor = processors.TemplateProcessing(
    single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
)
chat_template = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
hf_tok = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    bos_token="<|begin_of_text|>",
    eos_token="<|end_of_text|>",
    pad_token="<|end_of_text|>",
)
hf_tok.chat_template = chat_template
hf_tok.model_max_length = 8192
hf_tok.save_pretrained(out)

# 2) model: random-weight Llama
cfg = LlamaConfig(
    vocab_size=len(hf_tok),
    hidden_size=hidden,
    intermediate_size=inter,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=heads,
    head_dim=hidden // heads,
    max_position_embeddings=8192,
    bos_token_id=bos,
    eos_token_id=tok.token_to_id("<|end_of_text|>"),
    tie_word_embeddings=False,
)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
n = sum(p.numel() for p in model.parameters())
print(json.dumps({"out": out, "vocab": len(hf_tok), "params": n, "head_dim": hidden // heads}))

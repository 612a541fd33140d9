"""Tiny reward models built by transformers, and transformers' own scores for them.

    reward_models.py make OUT_DIR ROWS.jsonl

For every architecture verl users ship reward models in (Llama / Qwen2 / Qwen3 / Mistral
`*ForSequenceClassification`, and Qwen2.5-Math-RM's `Qwen2ForRewardModel` two-layer head) it
writes OUT_DIR/<case>/ (save_pretrained: config, safetensors, tokenizer with a chat template)
and, in OUT_DIR/expected.json, each row's score: the row's `prompt` messages plus its `response`
as the assistant turn, rendered by the tokenizer's own chat template, tokenized, and the head's
output at the last token, one row at a time (no padding), in float32.

Each case has its own tokenizer (own vocabulary and special tokens) and template, none of them the
policy's. The last line printed is a one-line verdict; the exit status is non-zero on failure.
"""

import json
import os
import sys

import torch
from torch import nn
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers, processors
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2Model,
    Qwen2PreTrainedModel,
)

CORPUS = [
    "What is 12 + 7? The answer is 19.",
    "Compute 3 * 4 and explain. Three times four is twelve.",
    "You are a helpful assistant. Answer briefly and show your work.",
    "The quick brown fox jumps over the lazy dog 0123456789 + - * / = ?",
    "#### 42 the final answer is boxed",
] * 20

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "[INST] {{ message['content'] }} [/INST]{% elif message['role'] == 'system' %}"
    "{{ message['content'] }}\n\n{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# case -> (tokenizer style, vocab size, config)
COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    num_labels=1,
)
CASES = {
    "llama": ("llama3", 420, dict(model_type="llama", architectures=["LlamaForSequenceClassification"], rope_theta=500000.0)),
    "mistral": ("mistral", 380, dict(model_type="mistral", architectures=["MistralForSequenceClassification"], sliding_window=None)),
    "qwen2": ("chatml", 350, dict(model_type="qwen2", architectures=["Qwen2ForSequenceClassification"], tie_word_embeddings=False)),
    "qwen3": ("chatml", 360, dict(model_type="qwen3", architectures=["Qwen3ForSequenceClassification"], head_dim=8, tie_word_embeddings=False)),
    "qwen2_rm": ("chatml", 340, dict(model_type="qwen2", architectures=["Qwen2ForRewardModel"], tie_word_embeddings=False)),
}


def make_tokenizer(style, vocab):
    if style == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        bos, eos, pad, template = "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", LLAMA3
    elif style == "mistral":
        specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
        # Its pad is not the EOS the template ends with: where they are one token, HF`s logits
        # read the token before the final EOS, verl (and verl-rs) the EOS itself.
        bos, eos, pad, template = "<s>", "</s>", "<unk>", MISTRAL
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        bos, eos, pad, template = None, "<|im_end|>", "<|endoftext|>", CHATML
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos is not None:
        # A `tokenizer(text)` of these families starts with BOS, as Llama's and Mistral's do.
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=None
    )
    fast.chat_template = template
    return fast


class Qwen2ForRewardModel(Qwen2PreTrainedModel):
    """The class Qwen2.5-Math-RM ships as remote code: Qwen2 + Linear(H, H), ReLU, Linear(H, 1)."""

    def __init__(self, config):
        super().__init__(config)
        self.model = Qwen2Model(config)
        h = config.hidden_size
        self.score = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1))
        self.post_init()

    def forward(self, input_ids):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return self.score(hidden)[:, -1]


def build(case, out):
    style, vocab, extra = CASES[case]
    tok = make_tokenizer(style, vocab)
    cfg_dict = dict(COMMON, vocab_size=len(tok), pad_token_id=tok.pad_token_id, **extra)
    model_type = cfg_dict.pop("model_type")
    torch.manual_seed(sum(map(ord, case)))
    config = AutoConfig.for_model(model_type, **cfg_dict)
    if case == "qwen2_rm":
        model = Qwen2ForRewardModel(config)
        with torch.no_grad():
            for lin in (model.score[0], model.score[2]):
                lin.bias.normal_(0.0, 0.2)
    else:
        model = AutoModelForSequenceClassification.from_config(config)
    model = model.float().eval()
    path = os.path.join(out, case)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    if case == "qwen2_rm":
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        c["architectures"] = ["Qwen2ForRewardModel"]
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
    return tok, model


def score(case, tok, model, chat):
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        if case == "qwen2_rm":
            return float(model(ids)[0, 0])
        return float(model(input_ids=ids).logits[0, -1])


def main():
    if len(sys.argv) != 4 or sys.argv[1] != "make":
        print(__doc__)
        sys.exit(2)
    out, rows_path = sys.argv[2], sys.argv[3]
    os.makedirs(out, exist_ok=True)
    with open(rows_path) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    expected = {}
    for case in CASES:
        tok, model = build(case, out)
        scores = []
        for r in rows:
            prompt = r["prompt"]
            chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            chat.append({"role": "assistant", "content": r["response"]})
            scores.append(score(case, tok, model, chat))
        expected[case] = scores
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    print(f"ok: {len(CASES)} reward models, {len(rows)} rows each, in {out}")


if __name__ == "__main__":
    main()

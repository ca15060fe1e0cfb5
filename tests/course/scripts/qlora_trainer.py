"""A QLoRA fine-tuning script in the style of the most-copied ones (the QLoRA paper's
``qlora.py``, the peft and bitsandbytes blog posts and their Colab notebooks; written here,
in our own words): the base model loaded in 4-bit NF4 with double quantization through
``BitsAndBytesConfig``, ``prepare_model_for_kbit_training`` (norms and embeddings to fp32,
gradient checkpointing, input gradients), LoRA adapters from ``get_peft_model``, a padded
causal-LM collator, and ``transformers.Trainer`` with fp16 and a paged 8-bit AdamW, no
reports and no checkpoints.

The model and its tokenizer are read from ``--model_name_or_path`` (a folder saved by
``save_pretrained``: the tests save a tiny Llama, so nothing is downloaded).

Run: ``python -m memmagic run --gpu T4 qlora_trainer.py --model_name_or_path PATH``."""

import argparse

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from torch.utils.data import Dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig,
                          DataCollatorForLanguageModeling, Trainer, TrainingArguments)

parser = argparse.ArgumentParser()
parser.add_argument("--model_name_or_path", required=True)
parser.add_argument("--output_dir", default="qlora-out")
parser.add_argument("--max_steps", type=int, default=2)
parser.add_argument("--per_device_train_batch_size", type=int, default=4)
parser.add_argument("--max_length", type=int, default=64)
parser.add_argument("--lora_r", type=int, default=8)
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token

bnb_config = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.float16,
)
model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path,
                                             quantization_config=bnb_config,
                                             device_map={"": 0})
model.config.use_cache = False
model = prepare_model_for_kbit_training(model)

lora_config = LoraConfig(
    r=args.lora_r,
    lora_alpha=2 * args.lora_r,
    lora_dropout=0.05,
    bias="none",
    task_type="CAUSAL_LM",
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
)
model = get_peft_model(model, lora_config)
model.print_trainable_parameters()


class InstructionDataset(Dataset):
    """A few prompt/answer pairs, tokenized once, of different lengths (the collator pads)."""

    def __init__(self, n=64):
        words = [w for w in tokenizer.get_vocab() if w.isalpha()]
        self.rows = []
        for i in range(n):
            prompt = " ".join(words[(7 * i + k) % len(words)] for k in range(8 + i % 5))
            answer = " ".join(words[(11 * i + k) % len(words)] for k in range(12 + i % 7))
            text = f"### Question: {prompt} ### Answer: {answer}"
            self.rows.append(tokenizer(text, truncation=True, max_length=args.max_length))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


training_args = TrainingArguments(
    output_dir=args.output_dir,
    per_device_train_batch_size=args.per_device_train_batch_size,
    gradient_accumulation_steps=1,
    max_steps=args.max_steps,
    learning_rate=2e-4,
    warmup_steps=1,
    lr_scheduler_type="cosine",
    fp16=True,
    optim="paged_adamw_8bit",
    logging_steps=1,
    report_to=[],
    save_strategy="no",
)
trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=InstructionDataset(),
    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
)
trainer.train()
print("training done")

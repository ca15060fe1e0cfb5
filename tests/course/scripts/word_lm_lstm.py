"""A script in the style of PyTorch's ``examples/word_language_model/main.py`` (written here,
in our own words): argparse options with ``--cuda``, a corpus turned into a word dictionary
and id tensors, ``batchify`` into columns, ``get_batch`` windows of ``bptt`` words, an
``RNNModel`` (embedding, ``nn.LSTM``, a linear decoder), the hidden state detached between
batches by ``repackage_hidden`` (truncated backpropagation through time), gradient clipping
with ``clip_grad_norm_`` and a hand-written SGD update ``p.data.add_(p.grad, alpha=-lr)``
(no optimizer object), an evaluation under ``torch.no_grad()`` and the model saved whole
with ``torch.save(model, f)`` when the validation loss improves.

The corpus is made in the script (random sentences over a small vocabulary) instead of read
from ``./data/wikitext-2``.

Run: ``python -m memmagic run --gpu T4 word_lm_lstm.py --cuda --epochs 1``."""

import argparse
import math
import os
import random
import time

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description="a word-level LSTM language model")
parser.add_argument("--emsize", type=int, default=128, help="size of word embeddings")
parser.add_argument("--nhid", type=int, default=256, help="hidden units per layer")
parser.add_argument("--nlayers", type=int, default=2, help="number of layers")
parser.add_argument("--lr", type=float, default=20, help="initial learning rate")
parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
parser.add_argument("--epochs", type=int, default=40, help="upper epoch limit")
parser.add_argument("--batch_size", type=int, default=16, metavar="N", help="batch size")
parser.add_argument("--bptt", type=int, default=32, help="sequence length")
parser.add_argument("--dropout", type=float, default=0.2, help="dropout applied to layers")
parser.add_argument("--seed", type=int, default=1111, help="random seed")
parser.add_argument("--cuda", action="store_true", default=False, help="use CUDA")
parser.add_argument("--log-interval", type=int, default=2, metavar="N", help="report interval")
parser.add_argument("--save", type=str, default="model.pt", help="path to save the final model")
args = parser.parse_args()

torch.manual_seed(args.seed)
if torch.cuda.is_available() and not args.cuda:
    print("WARNING: You have a CUDA device, so you should probably run with --cuda")
device = torch.device("cuda" if args.cuda else "cpu")


# -- the corpus ------------------------------------------------------------------------------------
class Dictionary:
    def __init__(self):
        self.word2idx, self.idx2word = {}, []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class Corpus:
    """Three splits of made-up text over 1,000 distinct words (with ``<eos>``): lines of ten
    words and an ``<eos>``, 200 for training, 40 for validation and test."""

    def __init__(self, n_words=1000, seed=0):
        rnd = random.Random(seed)
        words = [f"w{i}" for i in range(n_words - 1)]
        self.dictionary = Dictionary()
        for w in words + ["<eos>"]:  # every word in the dictionary, as a full corpus would have
            self.dictionary.add_word(w)
        self.train = self.tokenize(rnd, words, 200)
        self.valid = self.tokenize(rnd, words, 40)
        self.test = self.tokenize(rnd, words, 40)

    def tokenize(self, rnd, words, n_lines):
        ids = []
        for _ in range(n_lines):
            for w in rnd.choices(words, k=10) + ["<eos>"]:
                ids.append(self.dictionary.word2idx[w])
        return torch.tensor(ids, dtype=torch.int64)


corpus = Corpus()


def batchify(data, bsz):
    """The id stream cut into ``bsz`` columns (the rest dropped), on the device."""
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous().to(device)


eval_batch_size = 10
train_data = batchify(corpus.train, args.batch_size)
val_data = batchify(corpus.valid, eval_batch_size)


# -- the model -------------------------------------------------------------------------------------
class RNNModel(nn.Module):
    """Embedding, a multi-layer LSTM and a linear decoder back to the vocabulary."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid))


ntokens = len(corpus.dictionary)
model = RNNModel(ntokens, args.emsize, args.nhid, args.nlayers, args.dropout).to(device)
criterion = nn.NLLLoss()


def repackage_hidden(h):
    """The hidden state cut from the graph of the batch that made it."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def evaluate(data_source):
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train():
    model.train()
    total_loss = 0.0
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        total_loss += loss.item()
        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print("| epoch {:3d} | {:5d}/{:5d} batches | lr {:02.2f} | ms/batch {:5.2f} | "
                  "loss {:5.2f} | ppl {:8.2f}".format(epoch, batch, len(train_data) // args.bptt, lr,
                                                      elapsed * 1000 / args.log_interval, cur_loss,
                                                      math.exp(cur_loss)))
            total_loss = 0.0
            start_time = time.time()


lr = args.lr
best_val_loss = None
for epoch in range(1, args.epochs + 1):
    epoch_start_time = time.time()
    train()
    val_loss = evaluate(val_data)
    print("-" * 89)
    print("| end of epoch {:3d} | time: {:5.2f}s | valid loss {:5.2f} | valid ppl {:8.2f}".format(
        epoch, time.time() - epoch_start_time, val_loss, math.exp(val_loss)))
    print("-" * 89)
    if not best_val_loss or val_loss < best_val_loss:
        with open(args.save, "wb") as f:
            torch.save(model, f)
        best_val_loss = val_loss
    else:
        lr /= 4.0
print(f"saved: {os.path.exists(args.save)}")
